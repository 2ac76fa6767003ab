"""Checking a statement against the ledger's signed log, and the log against the newest
checkpoint this contributor verified before.

- ``GET /ledger/checkpoint``, whose Ed25519 signature must verify with the coordinator key pinned
  at join; ``GET /contributors/{id}/rewards/entries`` (the records of the reward entries); per
  reward ``GET /ledger/proofs/inclusion``. A reward verifies when its record says what the report
  says (round, contributor, amount, quality, reputation), and the leaf SHA-256(0x00 || record)
  reaches the signed root by its audit path (RFC 9162 §2.1.3.2). A reward recorded after the
  latest checkpoint cannot be checked yet: it is *pending*, reported but not a failure; only what
  contradicts the signed log fails.
- Rollback and fork: the newest checkpoint verified is kept per coordinator key in the state
  file. The coordinator's checkpoint now must be at least as large, the same root at the same
  size, and otherwise come with ``GET /ledger/proofs/consistency`` from the kept size to the new
  one that verifies (RFC 9162 §2.1.4.2) from the kept root to the new root. A log that shrank,
  forked or lost the kept checkpoint fails; a consistent one is kept instead.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from decimal import InvalidOperation
from pathlib import Path
from typing import Any, Literal

from zoo_gym.client.report.fetch import ApiRefused, ReportApi
from zoo_gym.client.report.statement import RewardsError, RoundLine, Statement, parse_amount
from zoo_gym.client.state import LocalState
from zoo_gym.core import merkle
from zoo_gym.core.checkpoints import SignedCheckpoint

CheckStatus = Literal["ok", "failed", "pending", "none"]
MARKS: dict[str, str] = {"ok": "✓", "failed": "✗", "pending": "…", "none": "–"}


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
        logged = parse_amount(fields.get("amount"))
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
