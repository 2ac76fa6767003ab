"""`verify_ledger`: replay the log and check it against itself, the rows and the checkpoints.

Every leaf hash must match its record, indices must run 0..n-1, every row must equal the values
the log last gave it, every row must be in the log, and every checkpoint must be signed and match
the root of the first `size` leaves as they are now; checkpoints kept outside the database show
a log rewritten after its newest checkpoints were deleted.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlmodel import Session, col, select

from zoo_gym.core import merkle
from zoo_gym.core.checkpoints import SignedCheckpoint, checkpoint_message
from zoo_gym.core.hashing import canonical_json
from zoo_gym.core.identity import verify
from zoo_gym.ledger.models import Checkpoint, LogEntry
from zoo_gym.ledger.records import (
    LOGGED_TABLES,
    READABLE_VERSIONS,
    _from_v1,
    _table_name,
    row_content,
    row_key,
)

SCHEDULED_CLOSES = frozenset({"published", "rolled_back"})
"""Round outcomes the round loop closes together with a signed checkpoint, in one transaction
(`zoo_gym.coordinator.rounds`); a round aborted by a restart is closed without one."""


@dataclass(frozen=True)
class Problem:
    """One discrepancy found by `verify_ledger`.

    `source` says what disagrees: "log" (the log itself: a gap, a leaf hash, a moved record),
    "kept" (the log against a checkpoint kept outside the database), "row" (a row against the
    log), "checkpoint" (a signed tree head in the database against the log, or a checkpoint
    missing where the schedule puts one). `index` is the log entry it points at (None when no
    entry does) and `kind` that entry's kind, or the table of a row the log does not know.
    """

    source: str
    index: int | None
    kind: str
    detail: str

    def __str__(self) -> str:
        where = "no entry" if self.index is None else f"entry {self.index}"
        return f"{self.source}: {where} ({self.kind}): {self.detail}"


@dataclass(frozen=True)
class VerifyReport:
    """Outcome of `verify_ledger`; `first` names the first tampered entry.

    `covered` is the size of the newest checkpoint in the database: entries from `covered` to
    `size - 1` are not signed yet (normal between rounds, not a problem). `kept` counts the
    checkpoints kept outside the database that the log was checked against.
    """

    size: int
    checkpoints: int
    problems: tuple[Problem, ...] = field(default_factory=tuple)
    covered: int = 0
    kept: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def first(self) -> Problem | None:
        return self.problems[0] if self.problems else None

    @property
    def uncovered(self) -> int:
        """Entries recorded after the newest checkpoint."""
        return max(self.size - self.covered, 0)


@dataclass
class _Expected:
    """Replayed state of one row: field -> (value, index, kind) of the entry that last set it."""

    created: tuple[int, str]
    fields: dict[str, tuple[Any, int, str]] = field(default_factory=dict)


@dataclass
class _Replay:
    """What replaying the log gives: its leaf hashes, every row's expected state, and the
    entries that closed a round (index, round number, status)."""

    leaves: list[bytes] = field(default_factory=list)
    state: dict[tuple[str, Any], _Expected] = field(default_factory=dict)
    closes: list[tuple[int, Any, str]] = field(default_factory=list)

    def apply(self, index: int, kind: str, record: dict[str, Any]) -> None:
        for row in record.get("rows", []):
            expected = self.state.setdefault((row["table"], row["key"]), _Expected((index, kind)))
            for name, value in row["fields"].items():
                if record["v"] == 1:
                    value = _from_v1(row["table"], name, value)
                expected.fields[name] = (value, index, kind)
            if kind == "round_close" and row["table"] == "rounds":
                self.closes.append((index, row["key"], str(row["fields"].get("status"))))


def _read_record(
    index: int, kind: str, record_bytes: bytes, problems: list[Problem]
) -> dict[str, Any] | None:
    """The record of entry `index` as JSON, or None (with a problem) when it cannot be replayed."""
    try:
        record: dict[str, Any] = json.loads(record_bytes)
    except ValueError:
        problems.append(Problem("log", index, kind, "record is not JSON"))
        return None
    if canonical_json(record) != record_bytes:
        problems.append(Problem("log", index, kind, "record is not canonical JSON"))
    if record.get("v") not in READABLE_VERSIONS:
        problems.append(Problem("log", index, kind, f"unknown record version {record.get('v')!r}"))
        return None
    if record.get("index") != index or record.get("kind") != kind:
        problems.append(
            Problem(
                "log",
                index,
                kind,
                f"entry holds the record of index {record.get('index')} "
                f"({record.get('kind')}): entries were moved",
            )
        )
    return record


def _replay_log(session: Session, problems: list[Problem]) -> _Replay:
    replay = _Replay()
    rows = session.exec(
        select(LogEntry.index, LogEntry.kind, LogEntry.record, LogEntry.leaf_hash).order_by(
            col(LogEntry.index)
        )
    )
    for index, kind, raw, stored_hash in rows:
        record_bytes = bytes(raw)
        expected_index = len(replay.leaves)
        if index != expected_index:
            problems.append(
                Problem(
                    "log",
                    expected_index,
                    "missing",
                    f"log jumps from index {expected_index} to {index}",
                )
            )
        replay.leaves.append(bytes(stored_hash))
        if merkle.leaf_hash(record_bytes) != bytes(stored_hash):
            problems.append(Problem("log", index, kind, "leaf hash does not match the record"))
        record = _read_record(index, kind, record_bytes, problems)
        if record is not None:
            replay.apply(index, kind, record)
    return replay


def _check_rows(
    session: Session, state: dict[tuple[str, Any], _Expected], problems: list[Problem]
) -> None:
    seen: set[tuple[str, Any]] = set()
    for model in LOGGED_TABLES:
        for row in session.exec(select(model)):
            key = (_table_name(row), row_key(row))
            seen.add(key)
            expected = state.get(key)
            if expected is None:
                problems.append(Problem("row", None, key[0], f"row {key[1]!r} is not in the log"))
                continue
            content = row_content(row)
            for name, (value, index, kind) in expected.fields.items():
                actual = content.get(name)
                if canonical_json(actual) != canonical_json(value):
                    problems.append(
                        Problem(
                            "row",
                            index,
                            kind,
                            f"{key[0]} {key[1]!r}: {name} is {actual!r}, the log says {value!r}",
                        )
                    )
    for key, expected in state.items():
        if key not in seen:
            index, kind = expected.created
            problems.append(Problem("row", index, kind, f"{key[0]} {key[1]!r} was deleted"))


def _check_checkpoints(
    heads: Sequence[Checkpoint], leaves: list[bytes], public_key: bytes, problems: list[Problem]
) -> None:
    roots = merkle.prefix_roots(leaves, [h.size for h in heads if 0 <= h.size <= len(leaves)])
    previous: Checkpoint | None = None
    for head in heads:
        name = f"checkpoint {head.id} (size {head.size})"
        message = checkpoint_message(size=head.size, root=head.root, signed_at=head.signed_at)
        try:
            signature = bytes.fromhex(head.signature)
        except ValueError:
            signature = b""
        if not verify(public_key, signature, message):
            problems.append(
                Problem("checkpoint", None, "checkpoint", f"{name}: signature does not verify")
            )
        if previous is not None and (
            head.size < previous.size or head.signed_at < previous.signed_at
        ):
            problems.append(
                Problem(
                    "checkpoint", None, "checkpoint", f"{name}: goes back from size {previous.size}"
                )
            )
        if head.size > len(leaves):
            problems.append(
                Problem(
                    "log", len(leaves), "missing", f"{name} covers entries the log no longer holds"
                )
            )
        elif head.size < 0 or roots[head.size].hex() != head.root:
            low = previous.size if previous is not None else 0
            problems.append(
                Problem(
                    "checkpoint",
                    None,
                    "checkpoint",
                    f"{name}: root differs from the log; an entry in {low}..{head.size - 1} "
                    "was rewritten",
                )
            )
        previous = head


def _check_schedule(
    closes: Sequence[tuple[int, Any, str]], covered: int, problems: list[Problem]
) -> None:
    """A round that ended normally is followed by a checkpoint: its close must be covered."""
    for index, number, status in closes:
        if status in SCHEDULED_CLOSES and index >= covered:
            problems.append(
                Problem(
                    "checkpoint",
                    index,
                    "round_close",
                    f"round {number} ended ({status}) but no checkpoint covers it: the one "
                    "signed with its close was deleted; compare the log with a checkpoint kept "
                    "outside the database (ledger verify --checkpoint FILE)",
                )
            )
            return


def _check_kept(
    kept: Sequence[SignedCheckpoint],
    heads: Sequence[Checkpoint],
    leaves: list[bytes],
    public_key: bytes,
    problems: list[Problem],
) -> None:
    """Each checkpoint kept outside the database: signed by `public_key`, its tree still in the
    log with the same root (RFC 9162 consistency of the log with it), and its row still stored."""
    roots = merkle.prefix_roots(leaves, [k.size for k in kept if k.size <= len(leaves)])
    stored = {(h.size, h.root, h.signature) for h in heads}
    for head in kept:
        name = f"kept {head.describe()}"
        if not head.signed_by(public_key):
            other = head.public_key and head.public_key != public_key.hex()
            why = "is signed by another key" if other else "has a signature that does not verify"
            problems.append(Problem("kept", None, "checkpoint", f"{name} {why}"))
            continue
        if head.size > len(leaves):
            detail = f"{name}, but the log holds only {len(leaves)} entries: the log shrank"
            problems.append(Problem("kept", len(leaves), "missing", detail))
            continue
        if roots[head.size].hex() != head.root:
            problems.append(
                Problem(
                    "kept",
                    None,
                    "checkpoint",
                    f"{name}, but the log's tree of that size has root "
                    f"{roots[head.size].hex()[:16]}…: an entry before {head.size} was rewritten "
                    "(the log forked)",
                )
            )
        if (head.size, head.root, head.signature) not in stored:
            detail = f"{name} is missing from the database: its row was deleted"
            problems.append(Problem("kept", None, "checkpoint", detail))


_SOURCE_ORDER = {"log": 0, "kept": 1, "row": 2, "checkpoint": 3}


def _order(problem: Problem) -> tuple[int, bool, int]:
    """Damage to the log itself first (it makes the row comparisons unreliable), then
    disagreements with checkpoints kept elsewhere, then the rest, each by index."""
    return (_SOURCE_ORDER[problem.source], problem.index is None, problem.index or 0)


def verify_ledger(
    session: Session, *, public_key: bytes, kept: Sequence[SignedCheckpoint] = ()
) -> VerifyReport:
    """Recompute the log and every row it describes; name the first tampered entry.

    Checks, in one pass over the log and one over each table: indices 0..n-1 without gaps, each
    leaf hash is SHA-256(0x00 || record) (RFC 9162 §2.1.1), each record is canonical, of a known
    version and sits at its own index; every row equals the values the log last recorded for it
    and every row is in the log; every checkpoint is signed by `public_key`, never shrinks and its
    root is the RFC 9162 root of the first `size` leaves; every round that ended published or
    rolled back is covered by a checkpoint (one is signed at each round's end).

    The database alone cannot show a rollback: deleting the newest checkpoints and rewriting what
    came after the ones left leaves a log that agrees with itself. `kept` are checkpoints kept
    outside the database; each must be signed by `public_key`, its size must not exceed the log's,
    the log's tree of its size must have its root, and its row must still be stored.

    Problems are ordered with damage to the log itself first (a deleted, moved or rewritten
    entry), then disagreements with kept checkpoints, rows that disagree with the log, then
    checkpoints in the database, each by index; `first` is the earliest of them.
    """
    problems: list[Problem] = []
    replay = _replay_log(session, problems)
    _check_rows(session, replay.state, problems)
    heads = list(session.exec(select(Checkpoint).order_by(col(Checkpoint.id))))
    _check_checkpoints(heads, replay.leaves, public_key, problems)
    covered = max((h.size for h in heads), default=0)
    _check_schedule(replay.closes, covered, problems)
    _check_kept(kept, heads, replay.leaves, public_key, problems)
    return VerifyReport(
        size=len(replay.leaves),
        checkpoints=len(heads),
        problems=tuple(sorted(problems, key=_order)),
        covered=covered,
        kept=len(kept),
    )
