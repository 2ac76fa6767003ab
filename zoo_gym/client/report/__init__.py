"""A contributor's reward statement: fetched from the coordinator's REST API, checked against the
ledger's signed checkpoint, and rendered for people (table, HTML page with a plot) or programs
(JSON, CSV).

1. Sign in: ``POST /auth/challenge``, sign `rest_challenge_statement` with the contributor key,
   ``POST /auth/token``; the token reads only this contributor's own records.
2. ``GET /contributors/{id}/report``: per round the decision and why, the quality score, the reward
   (an exact decimal), the reputation after the round, the privacy spent (epsilon) and the index of
   the log entry that recorded the reward; totals.
3. Verification (optional): ``GET /ledger/checkpoint``, whose Ed25519 signature must verify with
   the coordinator key pinned at join; ``GET /contributors/{id}/rewards/entries`` (the records of
   the reward entries); per reward ``GET /ledger/proofs/inclusion``. A reward verifies when its
   record says what the report says (round, contributor, amount, quality, reputation), and the
   leaf SHA-256(0x00 || record) reaches the signed root by its audit path (RFC 9162 §2.1.3.2).
   A reward recorded after the latest checkpoint cannot be checked yet: it is *pending*, reported
   but not a failure; only what contradicts the signed log fails.
4. Rollback and fork: the client keeps the newest checkpoint it verified per coordinator key in
   its state file. The coordinator's checkpoint now must be at least as large, the same root at
   the same size, and otherwise come with ``GET /ledger/proofs/consistency`` from the kept size
   to the new one that verifies (RFC 9162 §2.1.4.2) from the kept root to the new root. A log
   that shrank, forked or lost the kept checkpoint fails; a consistent one is kept instead.

The REST address is `--api` or `api_url` in client.toml; an https address is checked against the
config's `ca_cert` when one is set, else against the system's trusted CAs.

Split by job: `fetch` (sign in, fetch), `statement` (what the report says), `verify` (against the
signed log), `render` (table, JSON, CSV, HTML).
"""

from zoo_gym.client.report.fetch import (
    ApiRefused,
    ReportApi,
    api_base,
    connect,
    fetch_statement,
    pinned_coordinator_key,
)
from zoo_gym.client.report.render import money, render_table, to_csv, to_html, to_json
from zoo_gym.client.report.statement import RewardsError, RoundLine, Statement
from zoo_gym.client.report.verify import (
    Verification,
    keep_checkpoint,
    kept_checkpoint,
    record_mismatch,
    verify_statement,
)

__all__ = [
    "ApiRefused",
    "ReportApi",
    "RewardsError",
    "RoundLine",
    "Statement",
    "Verification",
    "api_base",
    "connect",
    "fetch_statement",
    "keep_checkpoint",
    "kept_checkpoint",
    "money",
    "pinned_coordinator_key",
    "record_mismatch",
    "render_table",
    "to_csv",
    "to_html",
    "to_json",
    "verify_statement",
]
