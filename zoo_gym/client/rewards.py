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
"""

from __future__ import annotations

import csv
import html
import io
import json
import math
import ssl
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any, Literal

import httpx
from rich.console import JustifyMethod
from rich.table import Table

from zoo_gym.client.state import LocalState
from zoo_gym.core import merkle
from zoo_gym.core.checkpoints import SignedCheckpoint
from zoo_gym.core.identity import Identity
from zoo_gym.core.protocol import rest_challenge_statement

AMOUNT_PLACES = 9

CheckStatus = Literal["ok", "failed", "pending", "none"]
MARKS: dict[str, str] = {"ok": "✓", "failed": "✗", "pending": "…", "none": "–"}


class RewardsError(Exception):
    """The statement cannot be fetched, read or trusted; the message says what to do."""


class ApiRefused(RewardsError):
    """The coordinator answered a request with an error status."""

    def __init__(self, status_code: int, message: str) -> None:
        super().__init__(message)
        self.status_code = status_code


# --- talking to the coordinator -----------------------------------------------------------------


def api_base(url: str) -> str:
    """The REST base address `url` (http:// or https://), without a trailing slash."""
    if not url:
        raise RewardsError(
            "no REST address: pass --api http://HOST:PORT or set api_url in client.toml"
        )
    if not url.startswith(("http://", "https://")):
        raise RewardsError(
            f"the REST address must start with http:// or https://, e.g. http://{url}"
        )
    return url.rstrip("/")


def connect(url: str, *, ca_cert: Path | None = None, timeout_s: float = 30.0) -> httpx.Client:
    """An HTTP client for the REST API at `url` (TLS checked against `ca_cert` when given)."""
    tls: ssl.SSLContext | bool = True
    if ca_cert is not None:
        tls = ssl.create_default_context(cafile=str(ca_cert))
    return httpx.Client(base_url=api_base(url), timeout=timeout_s, verify=tls)


def _detail(response: httpx.Response) -> str:
    try:
        detail = response.json().get("detail")
    except (ValueError, AttributeError):
        detail = None
    return str(detail) if detail else response.reason_phrase or "no detail"


@dataclass
class ReportApi:
    """The coordinator's REST API as one contributor sees it (signed in with its own key)."""

    http: httpx.Client
    identity: Identity
    token: str = ""

    @property
    def contributor_id(self) -> str:
        return self.identity.contributor_id

    def _refusal(self, path: str, response: httpx.Response) -> str:
        code, detail = response.status_code, _detail(response)
        if path.startswith("/auth/"):
            return (
                f"the coordinator refused to sign in contributor {self.contributor_id} "
                f"({code}: {detail}); has this key joined the network (`gym-client join`)?"
            )
        if code == 401:
            return f"the coordinator refused the sign-in token ({detail}); try again"
        if code == 403:
            return f"the coordinator refused access to {path} (403: {detail})"
        return f"the coordinator answered {code} to {path}: {detail}"

    def call(
        self,
        method: str,
        path: str,
        *,
        body: dict[str, Any] | None = None,
        params: dict[str, Any] | None = None,
    ) -> Any:
        """The JSON answer to one request; `RewardsError` for anything the user can act on."""
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        try:
            response = self.http.request(method, path, json=body, params=params, headers=headers)
        except httpx.RequestError as exc:
            raise RewardsError(
                f"cannot reach the coordinator's REST API at {self.http.base_url} "
                f"({type(exc).__name__}: {exc}); check --api or api_url in client.toml"
            ) from None
        if response.status_code >= 400:
            raise ApiRefused(response.status_code, self._refusal(path, response))
        try:
            return response.json()
        except ValueError:
            raise RewardsError(
                f"{self.http.base_url} did not answer {path} with JSON; "
                "is that the coordinator's REST address?"
            ) from None

    def sign_in(self) -> None:
        """Answer a sign-in challenge with the contributor key; keep the token."""
        cid = self.contributor_id
        challenge = self.call("POST", "/auth/challenge", body={"contributor_id": cid})
        statement = rest_challenge_statement(
            cid, str(challenge["nonce"]), int(challenge["expires_at_ms"])
        )
        answer = {
            "contributor_id": cid,
            "nonce": challenge["nonce"],
            "signature": self.identity.sign(statement).hex(),
        }
        self.token = str(self.call("POST", "/auth/token", body=answer)["access_token"])

    def get(self, path: str, params: dict[str, Any] | None = None) -> Any:
        """GET `path` signed in; a token that expired on the way is renewed once."""
        if not self.token:
            self.sign_in()
        try:
            return self.call("GET", path, params=params)
        except ApiRefused as exc:
            if exc.status_code != 401:
                raise
        self.sign_in()
        return self.call("GET", path, params=params)


def pinned_coordinator_key(state_path: Path) -> bytes:
    """The coordinator's signing key that `gym-client join` pinned in `state_path`."""
    try:
        pinned = LocalState.load(state_path).coordinator_key
    except (ValueError, TypeError) as exc:
        raise RewardsError(f"{state_path} is not readable client state ({exc})") from None
    if not pinned:
        raise RewardsError(
            f"no coordinator key is pinned in {state_path}; run `gym-client join` once "
            "(it pins the key the coordinator signs with), then verify"
        )
    try:
        return bytes.fromhex(pinned)
    except ValueError:
        raise RewardsError(f"{state_path}: coordinator_key is not hex") from None


# --- the statement ------------------------------------------------------------------------------


def _amount(value: Any) -> Decimal:
    amount = Decimal(str(value))
    if not amount.is_finite():
        raise ValueError(f"amount {value!r} is not a finite decimal")
    return amount


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)


@dataclass(frozen=True)
class RoundLine:
    """One round of the statement."""

    round: int
    round_status: str | None
    decision: str
    reason: str
    reward_reason: str
    selected: bool | None
    score: float | None
    quality: float | None
    amount: Decimal
    reputation_after: float | None
    epsilon: float | None
    reward_id: int | None
    log_index: int | None

    @classmethod
    def from_json(cls, row: dict[str, Any]) -> RoundLine:
        return cls(
            round=int(row["round"]),
            round_status=row.get("round_status"),
            decision=str(row["decision"]),
            reason=str(row.get("reason") or ""),
            reward_reason=str(row.get("reward_reason") or ""),
            selected=row.get("selected"),
            score=_opt_float(row.get("score")),
            quality=_opt_float(row.get("quality")),
            amount=_amount(row["amount"]),
            reputation_after=_opt_float(row.get("reputation_after")),
            epsilon=_opt_float(row.get("epsilon")),
            reward_id=_opt_int(row.get("reward_id")),
            log_index=_opt_int(row.get("log_index")),
        )

    @property
    def why(self) -> str:
        """The decision's reason and, when it says more, the reward's."""
        if self.reason and self.reason in self.reward_reason:  # the reward's reason repeats it
            return self.reward_reason
        if self.reward_reason and self.reward_reason != self.reason:
            return f"{self.reason}; {self.reward_reason}" if self.reason else self.reward_reason
        return self.reason


@dataclass(frozen=True)
class Totals:
    rounds: int
    submissions: int
    accepted: int
    rejected: int
    selected: int
    rewarded: int
    amount: Decimal
    epsilon: float | None
    epsilon_delta: float | None = None  # the delta a composed epsilon holds for; None for a sum


@dataclass(frozen=True)
class Statement:
    """A contributor's report as the coordinator served it (`raw`) and parsed."""

    contributor_id: str
    name: str
    status: str
    reputation: float
    rounds: tuple[RoundLine, ...]
    totals: Totals
    raw: dict[str, Any] = field(repr=False)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Statement:
        try:
            t = data["totals"]
            totals = Totals(
                rounds=int(t["rounds"]),
                submissions=int(t["submissions"]),
                accepted=int(t["accepted"]),
                rejected=int(t["rejected"]),
                selected=int(t["selected"]),
                rewarded=int(t["rewarded"]),
                amount=_amount(t["amount"]),
                epsilon=_opt_float(t.get("epsilon")),
                epsilon_delta=_opt_float(t.get("epsilon_delta")),
            )
            return cls(
                contributor_id=str(data["contributor_id"]),
                name=str(data["name"]),
                status=str(data["status"]),
                reputation=float(data["reputation"]),
                rounds=tuple(RoundLine.from_json(r) for r in data["rounds"]),
                totals=totals,
                raw=data,
            )
        except (KeyError, TypeError, ValueError, InvalidOperation) as exc:
            raise RewardsError(
                f"the coordinator's report (version {data.get('version', 1)}) is not in a form "
                f"this client reads ({type(exc).__name__}: {exc}); update zoo-gym"
            ) from None


def fetch_statement(api: ReportApi) -> Statement:
    """Sign in (if needed) and fetch the contributor's own report."""
    data = api.get(f"/contributors/{api.contributor_id}/report")
    if not isinstance(data, dict):
        raise RewardsError("the coordinator's report is not a JSON object; update zoo-gym")
    return Statement.from_json(data)


# --- verification -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Check:
    """Whether one round's reward is backed by the signed log."""

    status: CheckStatus
    detail: str

    @property
    def mark(self) -> str:
        return MARKS[self.status]


@dataclass(frozen=True)
class Verification:
    """Outcome of `verify_statement`: a check per round and the first failure, if any."""

    size: int
    root: str
    signed_at: str
    checks: dict[int, Check]
    problem: str | None = None
    checkpoint: SignedCheckpoint | None = None  # verified: signature and consistency
    grew_from: int | None = None  # size of the kept checkpoint the log was proven to extend

    @property
    def ok(self) -> bool:
        return self.problem is None

    @property
    def counts(self) -> Counter[str]:
        return Counter(c.status for c in self.checks.values())

    def summary(self) -> str:
        """One line: what was verified against which checkpoint."""
        n = self.counts
        if self.problem is not None:
            return f"verification FAILED: {self.problem}"
        if self.size == 0:
            return (
                "the coordinator has not signed a checkpoint yet: nothing could be verified "
                "(verify again once it signs one)"
            )
        text = (
            f"{n['ok']} reward(s) verified against the checkpoint of size {self.size} "
            f"(root {self.root[:16]}…, signed {self.signed_at})"
        )
        if self.grew_from is not None:
            text += f"; the log extends the checkpoint of size {self.grew_from} verified before"
        if n["pending"]:
            text += (
                f"; {n['pending']} recorded after it cannot be checked yet "
                "(verify again once the coordinator signs a newer checkpoint)"
            )
        return text

    def as_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "problem": self.problem,
            "checkpoint": {"size": self.size, "root": self.root, "signed_at": self.signed_at},
            "verified": self.counts["ok"],
            "failed": self.counts["failed"],
            "pending": self.counts["pending"],
            "extends_kept_size": self.grew_from,
        }


UNPAID = Check("none", "no reward was recorded for this round")
MALFORMED = (KeyError, TypeError, ValueError, AttributeError)
"""What reading a malformed answer of the coordinator raises."""


def _unhex(value: Any) -> bytes:
    try:
        return bytes.fromhex(str(value))
    except ValueError:
        return b""


def record_mismatch(record: bytes, line: RoundLine, contributor_id: str) -> str | None:
    """What the reward entry's `record` says differently from the report's `line` (None: same)."""
    try:
        body = json.loads(record)
    except ValueError:
        return "its record is not JSON"
    if body.get("index") != line.log_index or body.get("kind") != "reward":
        return f"it is entry {body.get('index')} of kind {body.get('kind')!r}, not a reward entry"
    fields = next(
        (
            r.get("fields", {})
            for r in body.get("rows", [])
            if r.get("table") == "rewards" and r.get("key") == line.reward_id
        ),
        None,
    )
    if fields is None:
        return f"its record does not hold reward {line.reward_id}"
    try:
        logged = _amount(fields.get("amount"))
    except (ValueError, InvalidOperation):
        logged = None
    if logged != line.amount:
        return f"the report pays {line.amount:.9f}, the log {fields.get('amount')}"
    expected = {
        "round_number": line.round,
        "contributor_id": contributor_id,
        "quality": line.quality,
        "reputation_after": line.reputation_after,
    }
    for name, value in expected.items():
        if fields.get(name) != value:
            return f"{name} is {value!r} in the report, {fields.get(name)!r} in the log"
    return None


def _check_line(
    api: ReportApi,
    line: RoundLine,
    *,
    size: int,
    root: bytes,
    records: dict[int, bytes],
) -> Check:
    index = line.log_index
    if line.reward_id is None:
        return UNPAID
    if index is None:
        return Check("failed", f"the report names no log entry for reward {line.reward_id}")
    if index >= size:
        return Check("pending", f"entry {index} is newer than the checkpoint (size {size})")
    record = records.get(index)
    if record is None:
        return Check("failed", f"the coordinator does not serve the record of entry {index}")
    mismatch = record_mismatch(record, line, api.contributor_id)
    if mismatch is not None:
        return Check("failed", mismatch)
    proof = api.get("/ledger/proofs/inclusion", params={"index": index, "tree_size": size})
    try:
        path = [_unhex(p) for p in proof["path"]]
    except MALFORMED:
        return Check("failed", f"the coordinator served a malformed proof for entry {index}")
    if not merkle.verify_inclusion(index, size, merkle.leaf_hash(record), path, root):
        return Check(
            "failed",
            "its inclusion proof does not reach the signed root: the log served now is not "
            "the log the coordinator signed",
        )
    return Check("ok", f"entry {index} is in the signed tree of size {size}")


def _all(statement: Statement, status: CheckStatus, detail: str) -> dict[int, Check]:
    """The same check for every paid round (unpaid rounds have nothing to verify)."""
    return {
        line.round: UNPAID if line.reward_id is None else Check(status, detail)
        for line in statement.rounds
    }


def _checkpoint(head: Any) -> SignedCheckpoint:
    """The checkpoint the coordinator served."""
    try:
        return SignedCheckpoint.from_json(head)
    except ValueError as exc:
        raise RewardsError(
            f"the coordinator served a malformed checkpoint ({exc}); nothing can be verified"
        ) from None


def _forged(head: Any, signed: SignedCheckpoint, coordinator_key: bytes) -> str | None:
    """Why `signed` cannot be trusted, or None when the pinned key signed it."""
    if signed.signed_by(coordinator_key):
        return None
    served = str(head.get("public_key", ""))
    why = (
        "is signed by another key than the coordinator key pinned at join"
        if served and served != coordinator_key.hex()
        else "carries a signature that does not verify with the pinned coordinator key"
    )
    return f"the latest checkpoint (size {signed.size}) {why}; none of its entries can be trusted"


def consistency_problem(
    api: ReportApi, kept: SignedCheckpoint, current: SignedCheckpoint
) -> str | None:
    """Why the log behind `current` is not an extension of the one `kept` signed (None: it is).

    RFC 9162 §2.1.4: equal sizes need equal roots; a larger tree needs a consistency proof from
    `kept.size` to `current.size` that verifies from `kept.root` to `current.root`.
    """
    stamp = f"{kept.signed_at:%Y-%m-%d %H:%M} UTC"
    was = f"the checkpoint of size {kept.size} you verified (signed {stamp})"
    if current.size < kept.size:
        return (
            f"the log shrank: the coordinator's newest checkpoint has size {current.size}, "
            f"smaller than {was}; entries were removed (a rollback)"
        )
    if current.size == kept.size:
        if current.root == kept.root:
            return None
        return f"the log forked: its checkpoint of size {current.size} has another root than {was}"
    params = {"old_size": kept.size, "new_size": current.size}
    try:
        proof = api.get("/ledger/proofs/consistency", params=params)
        path, served_old = [_unhex(p) for p in proof["path"]], str(proof["old_root"])
    except ApiRefused as exc:
        return f"the coordinator cannot prove that its log extends {was} ({exc})"
    except MALFORMED:
        return f"the coordinator served a malformed consistency proof from {was}"
    if served_old != kept.root:
        return (
            f"the log forked: its tree of size {kept.size} now has root {served_old[:16]}…, "
            f"not the root {kept.root[:16]}… of {was}; an entry before {kept.size} was rewritten"
        )
    if not merkle.verify_consistency(
        kept.size, current.size, _unhex(kept.root), _unhex(current.root), path
    ):
        return (
            f"the log forked: the proof that the checkpoint of size {current.size} extends "
            f"{was} does not verify (RFC 9162 consistency)"
        )
    return None


def _fetch_records(api: ReportApi, statement: Statement, size: int) -> dict[int, bytes]:
    """The records of this contributor's reward entries, when any is in the signed tree."""
    if not any(line.log_index is not None and line.log_index < size for line in statement.rounds):
        return {}
    entries = api.get(f"/contributors/{api.contributor_id}/rewards/entries")
    try:
        return {int(e["index"]): str(e["record"]).encode() for e in entries}
    except MALFORMED:
        raise RewardsError("the coordinator served malformed log entries") from None


def verify_statement(
    api: ReportApi,
    statement: Statement,
    *,
    coordinator_key: bytes,
    kept: SignedCheckpoint | None = None,
) -> Verification:
    """Check every reward of `statement` against the latest checkpoint signed by
    `coordinator_key`, and that checkpoint against `kept`, the newest one verified before
    (`consistency_problem`); `problem` names the first entry (or the checkpoint) that fails.
    `checkpoint` of the answer is the served one once its signature and consistency held."""
    try:
        head = api.get("/ledger/checkpoint")
    except ApiRefused as exc:
        if exc.status_code != 404:
            raise
        if kept is not None:
            gone = (
                f"the coordinator serves no checkpoint, but you verified one of size {kept.size} "
                "before: its checkpoints were deleted (a rollback)"
            )
            return Verification(0, "", "", _all(statement, "failed", gone), gone)
        return Verification(0, "", "", _all(statement, "pending", "no checkpoint is signed yet"))
    signed = _checkpoint(head)
    size, root, stamp = signed.size, signed.root, signed.signed_at.isoformat()
    problem = _forged(head, signed, coordinator_key)
    if problem is None and kept is not None:
        problem = consistency_problem(api, kept, signed)
    if problem is not None:
        return Verification(size, root, stamp, _all(statement, "failed", problem), problem)
    records = _fetch_records(api, statement, size)
    checks: dict[int, Check] = {}
    for line in statement.rounds:
        check = _check_line(api, line, size=size, root=_unhex(root), records=records)
        checks[line.round] = check
        if check.status == "failed" and problem is None:
            problem = f"ledger entry {line.log_index} (round {line.round}): {check.detail}"
    grew_from = kept.size if kept is not None else None
    return Verification(size, root, stamp, checks, problem, signed, grew_from)


def kept_checkpoint(state_path: Path, coordinator_key: bytes) -> SignedCheckpoint | None:
    """The newest checkpoint signed by `coordinator_key` verified before, from the state file."""
    stored = LocalState.load(state_path).checkpoints.get(coordinator_key.hex())
    if stored is None:
        return None
    try:
        return SignedCheckpoint.from_json(stored)
    except ValueError as exc:
        raise RewardsError(
            f"{state_path}: the checkpoint kept for this coordinator is malformed ({exc}); "
            "restore the file from a backup"
        ) from None


def keep_checkpoint(state_path: Path, coordinator_key: bytes, head: SignedCheckpoint) -> None:
    """Remember `head` (verified) as the newest checkpoint of `coordinator_key`."""
    state = LocalState.load(state_path)
    state.checkpoints[coordinator_key.hex()] = head.to_json()
    state.save()


# --- rendering ----------------------------------------------------------------------------------


def exact(amount: Decimal) -> str:
    """An amount with all 9 places, as the ledger stores it."""
    return f"{amount:.{AMOUNT_PLACES}f}"


def money(amount: Decimal) -> str:
    """An amount for people: at least 2 places, no trailing zeros beyond them."""
    whole, _, places = exact(amount).partition(".")
    return f"{whole}.{places.rstrip('0').ljust(2, '0')}"


def _num(value: float | None, spec: str, none: str = "—") -> str:
    return none if value is None else format(value, spec)


def epsilon_text(value: float | None, delta: float | None = None) -> str:
    text = _num(value, ".2f", none="n/a")
    return text if value is None or delta is None else f"{text} (δ={delta:g})"


def _decision(line: RoundLine) -> str:
    if line.decision == "accepted" and line.selected is False:
        return "accepted, not selected"
    return line.decision


def _totals(statement: Statement, verification: Verification | None) -> list[str]:
    """The cells of the totals row, shared by the table and the HTML page."""
    t = statement.totals
    totals = [
        "total",
        f"{t.accepted} accepted, {t.rejected} rejected",
        f"{t.rewarded} of {t.rounds} round(s) rewarded",
        "",
        money(t.amount),
        f"{statement.reputation:.3f}",
        epsilon_text(t.epsilon, t.epsilon_delta),
    ]
    if verification is not None:
        n = verification.counts
        totals.append(f"{n['ok']}/{n['ok'] + n['failed'] + n['pending']}")
    return totals


def render_table(statement: Statement, verification: Verification | None = None) -> Table:
    """The statement as a rich table, totals in the last row."""
    s = statement
    table = Table(
        title=f"rewards of {s.name} ({s.contributor_id[:12]}, {s.status})",
        caption=f"reputation now {s.reputation:.3f}",
    )
    columns: tuple[tuple[str, JustifyMethod], ...] = (
        ("round", "right"),
        ("decision", "left"),
        ("why", "left"),
        ("quality", "right"),
        ("reward", "right"),
        ("reputation", "right"),
        ("ε", "right"),
    )
    for name, justify in columns:
        table.add_column(name, justify=justify)
    if verification is not None:
        table.add_column("ledger", justify="center")
    for line in s.rounds:
        cells = [
            str(line.round),
            _decision(line),
            line.why,
            _num(line.quality, "+.4f"),
            money(line.amount),
            _num(line.reputation_after, ".3f"),
            epsilon_text(line.epsilon),
        ]
        if verification is not None:
            cells.append(verification.checks[line.round].mark)
        table.add_row(*cells, style="red" if line.decision == "rejected" else None)
    table.add_section()
    totals = _totals(statement, verification)
    table.add_row(*totals, style="bold")
    return table


def to_json(statement: Statement, verification: Verification | None = None) -> str:
    """The report as served, plus each round's check and a summary when verified."""
    body = dict(statement.raw)
    if verification is not None:
        rows = []
        for row in body.get("rounds", []):
            check = verification.checks[int(row["round"])]
            rows.append({**row, "verified": check.status, "verify_detail": check.detail})
        body["rounds"] = rows
        body["verification"] = verification.as_dict()
    return json.dumps(body, indent=2, ensure_ascii=False) + "\n"


CSV_COLUMNS = (
    "round",
    "round_status",
    "decision",
    "reason",
    "reward_reason",
    "selected",
    "score",
    "quality",
    "reward",
    "reputation_after",
    "epsilon",
    "log_index",
    "verified",
)


def to_csv(statement: Statement, verification: Verification | None = None) -> str:
    """One row per round, then a row whose round is "total"; exact amounts; empty cells for
    missing values (no epsilon, not scored)."""

    def cell(value: Any) -> Any:
        return "" if value is None else value

    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for line in statement.rounds:
        check = verification.checks[line.round].status if verification is not None else None
        values = (
            line.round,
            line.round_status,
            line.decision,
            line.reason,
            line.reward_reason,
            line.selected,
            line.score,
            line.quality,
            exact(line.amount),
            line.reputation_after,
            line.epsilon,
            line.log_index,
            check,
        )
        writer.writerow([cell(v) for v in values])
    t = statement.totals
    summary = None if verification is None else ("ok" if verification.ok else "failed")
    totals = ("total", None, f"{t.accepted} accepted", f"{t.rejected} rejected", None)
    writer.writerow(
        [cell(v) for v in totals]
        + ["", "", "", exact(t.amount), statement.reputation, cell(t.epsilon), "", cell(summary)]
    )
    return out.getvalue()


ACCEPTED_COLOUR, REJECTED_COLOUR, QUALITY_COLOUR = "#2a9d8f", "#e76f51", "#264653"


def plot_svg(statement: Statement) -> str:
    """Rewards (bars) and quality (line, right axis) per round as an inline SVG element."""
    import matplotlib
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    lines = statement.rounds
    rounds = [line.round for line in lines]
    fig = Figure(figsize=(10, 3.6), layout="constrained")
    ax = fig.add_subplot()
    colours = [ACCEPTED_COLOUR if x.decision == "accepted" else REJECTED_COLOUR for x in lines]
    ax.bar(rounds, [float(x.amount) for x in lines], width=0.6, color=colours)
    rejected = [x.round for x in lines if x.decision != "accepted"]
    ax.scatter(rejected, [0.0] * len(rejected), marker="x", color=REJECTED_COLOUR, zorder=3)
    ax.set_xlabel("round")
    ax.set_ylabel("reward")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(axis="y", alpha=0.3)
    quality = ax.twinx()
    values = [math.nan if x.quality is None else x.quality for x in lines]
    quality.plot(rounds, values, color=QUALITY_COLOUR, marker="o", linewidth=1.5)
    quality.set_ylabel("quality")
    handles = [
        Patch(color=ACCEPTED_COLOUR, label="reward (accepted)"),
        Line2D([], [], color=REJECTED_COLOUR, marker="x", linestyle="", label="rejected"),
        Line2D([], [], color=QUALITY_COLOUR, marker="o", label="quality"),
    ]
    quality.axhline(0.0, color=QUALITY_COLOUR, linewidth=0.6, linestyle=":")
    ax.legend(
        handles=handles,
        loc="lower left",
        bbox_to_anchor=(0.0, 1.0),
        ncols=3,
        frameon=False,
        fontsize="small",
    )
    buf = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "path", "svg.hashsalt": "zoo-gym"}):
        fig.savefig(buf, format="svg", metadata={"Date": None})
    svg = buf.getvalue()
    return svg[svg.index("<svg") :]


CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,Helvetica,Arial,sans-serif;
 color:#1d2733;background:#fff;max-width:1100px;margin:2rem auto;padding:0 1rem}
h1{font-size:1.5rem;margin:0 0 .3rem}
.meta{color:#5b6b7b;margin:0 0 1rem;font-size:.9rem}
code{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace}
.cards{display:flex;flex-wrap:wrap;gap:.8rem;margin:1rem 0}
.card{border:1px solid #d8dee4;border-radius:8px;padding:.5rem .9rem;min-width:8.5rem}
.card span{color:#5b6b7b;font-size:.8rem}.card b{display:block;font-size:1.25rem}
.banner{padding:.6rem 1rem;border-radius:6px;margin:1rem 0;font-weight:600}
.banner.ok{background:#e6f4ea;color:#1e6b34}.banner.failed{background:#fdecea;color:#a02323}
.banner.pending{background:#fff6e0;color:#7a5a00}
figure{margin:1rem 0}figure svg{width:100%;height:auto}
figcaption{color:#5b6b7b;font-size:.85rem}
table{border-collapse:collapse;width:100%;font-size:.9rem}
th,td{padding:.35rem .6rem;border-bottom:1px solid #e3e8ee;text-align:left;vertical-align:top}
th{background:#f3f5f7}.num{text-align:right;font-variant-numeric:tabular-nums}
tr.rejected td{color:#a02323}
tfoot td{font-weight:700;border-top:2px solid #1d2733;border-bottom:none}
.mark{text-align:center;font-weight:700}.mark.ok{color:#1e6b34}.mark.failed{color:#a02323}
.mark.pending{color:#7a5a00}.mark.none{color:#9aa5b1}
"""


def _cards(statement: Statement) -> str:
    s, t = statement, statement.totals
    cards = (
        ("total reward", money(t.amount)),
        ("rounds", str(t.rounds)),
        ("accepted / rejected", f"{t.accepted} / {t.rejected}"),
        ("rewarded rounds", str(t.rewarded)),
        ("reputation", f"{s.reputation:.3f}"),
        ("privacy spent (ε)", epsilon_text(t.epsilon, t.epsilon_delta)),
    )
    items = "".join(
        f'<div class="card"><span>{html.escape(k)}</span><b>{html.escape(v)}</b></div>'
        for k, v in cards
    )
    return f'<div class="cards">{items}</div>'


def _banner(verification: Verification | None) -> str:
    if verification is None:
        return ""
    if not verification.ok:
        kind = "failed"
    elif verification.counts["pending"] or verification.size == 0:
        kind = "pending"
    else:
        kind = "ok"
    text = ("✓ " if kind == "ok" else "✗ " if kind == "failed" else "… ") + verification.summary()
    return f'<p class="banner {kind}">{html.escape(text)}</p>'


def _rows(statement: Statement, verification: Verification | None) -> str:
    rows = []
    for line in statement.rounds:
        cells = [
            f'<td class="num">{line.round}</td>',
            f"<td>{html.escape(_decision(line))}</td>",
            f"<td>{html.escape(line.why)}</td>",
            f'<td class="num">{_num(line.quality, "+.4f")}</td>',
            f'<td class="num" title="{exact(line.amount)}">{money(line.amount)}</td>',
            f'<td class="num">{_num(line.reputation_after, ".3f")}</td>',
            f'<td class="num">{epsilon_text(line.epsilon)}</td>',
        ]
        if verification is not None:
            check = verification.checks[line.round]
            cells.append(
                f'<td class="mark {check.status}" title="{html.escape(check.detail)}">'
                f"{check.mark}</td>"
            )
        kind = "rejected" if line.decision == "rejected" else "accepted"
        rows.append(f'<tr class="{kind}">{"".join(cells)}</tr>')
    return "\n".join(rows)


def to_html(
    statement: Statement, verification: Verification | None = None, *, source: str = ""
) -> str:
    """A self-contained page (inline CSS and SVG, nothing fetched): summary, verification status,
    a plot of rewards and quality per round, the table and its totals."""
    s = statement
    generated = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    head = ["round", "decision", "why", "quality", "reward", "reputation", "ε"]
    if verification is not None:
        head.append("ledger")
    align = ["num", "", "", "num", "num", "num", "num", "mark"][: len(head)]
    header = "".join(
        f'<th class="{a}">{html.escape(h)}</th>' for a, h in zip(align, head, strict=True)
    )
    totals = _totals(statement, verification)
    foot = "".join(
        f'<td class="{a}">{html.escape(v)}</td>' for a, v in zip(align, totals, strict=True)
    )
    figure = (
        f"<figure>{plot_svg(s)}<figcaption>Reward (bars) and contribution quality (line, right "
        "axis) per round.</figcaption></figure>"
        if s.rounds
        else "<p>No rounds yet.</p>"
    )
    where = f" · from {html.escape(source)}" if source else ""
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>zoo-gym rewards: {html.escape(s.name)}</title>
<style>{CSS}</style>
</head>
<body>
<h1>Reward statement of {html.escape(s.name)}</h1>
<p class="meta">contributor <code>{html.escape(s.contributor_id)}</code> · {html.escape(s.status)}{where} · generated {generated}</p>
{_cards(s)}
{_banner(verification)}
{figure}
<table>
<thead><tr>{header}</tr></thead>
<tbody>
{_rows(s, verification)}
</tbody>
<tfoot><tr>{foot}</tr></tfoot>
</table>
</body>
</html>
"""
