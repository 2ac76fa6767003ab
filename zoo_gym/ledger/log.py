"""The append-only Merkle log behind every ledger row, its signed checkpoints and its audit.

Each change a repository function makes is appended, in the same transaction, as one log entry
whose record is canonical JSON (`zoo_gym.core.hashing.canonical_json`):

    {"v": 1, "index": i, "kind": "...", "rows": [{"table": t, "key": k, "fields": {...}}]}

`fields` holds the new values of the columns the change set, in the same normalised form
`row_content` derives from a stored row. Leaf i of the tree is SHA-256(0x00 || record) and the
tree is the Merkle tree of RFC 9162 §2.1 (`zoo_gym.core.merkle`). A checkpoint is the signed
tree head: an Ed25519 signature over canonical {"v", "kind", "size", "root", "signed_at"}.

`verify_ledger` replays the log: every leaf hash must match its record, indices must run 0..n-1,
every row must equal the values the log last gave it, every row must be in the log, and every
checkpoint must be signed and match the root of the first `size` leaves as they are now.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import (
    JSON,
    Boolean,
    ColumnElement,
    DateTime,
    Float,
    Integer,
    LargeBinary,
    Numeric,
    TypeDecorator,
    func,
    literal,
    text,
)
from sqlmodel import Session, SQLModel, col, select

from zoo_gym.core import merkle
from zoo_gym.core.checkpoints import SignedCheckpoint
from zoo_gym.core.checkpoints import checkpoint_message as checkpoint_message
from zoo_gym.core.hashing import canonical_json
from zoo_gym.core.identity import Identity, verify
from zoo_gym.ledger.db import IMMEDIATE
from zoo_gym.ledger.models import (
    AuditEvent,
    Checkpoint,
    Contributor,
    LogEntry,
    ModelVersion,
    Reward,
    Round,
    Submission,
    utcnow,
)

RECORD_VERSION = 2
READABLE_VERSIONS = (1, 2)  # 1: amounts as floats (before exact decimals)

# Key of the PostgreSQL transaction-level advisory lock that serialises appends ("zoolog").
APPEND_LOCK_KEY = 0x7A6F6F6C6F67

LOGGED_TABLES: tuple[type[SQLModel], ...] = (
    Contributor,
    Round,
    Submission,
    Reward,
    ModelVersion,
    AuditEvent,
)

_COLUMN_TYPES: dict[tuple[str, str], Any] = {
    (str(m.__table__.name), c.name): c.type  # type: ignore[attr-defined]
    for m in LOGGED_TABLES
    for c in m.__table__.columns  # type: ignore[attr-defined]
}
# Float subclasses Numeric; only exact NUMERIC columns changed form between versions
_COLUMN_TYPES = {k: t for k, t in _COLUMN_TYPES.items() if not isinstance(t, Float)}

RowChange = tuple[SQLModel, Sequence[str] | None]
"""A row and the columns of it a log entry records (None: every column)."""


# --- records ------------------------------------------------------------------------------------


def _normalise(column_type: Any, value: Any) -> Any:
    """JSON form of a column value, identical before and after a round trip through any backend."""
    if value is None:
        return None
    if isinstance(column_type, TypeDecorator):
        column_type = column_type.impl_instance
    if isinstance(column_type, Boolean):
        return bool(value)
    if isinstance(column_type, Integer):
        return int(value)
    if isinstance(column_type, Float):
        return float(value)
    if isinstance(column_type, Numeric):  # exact decimals, as a fixed-scale string on every backend
        return format(Decimal(value).quantize(Decimal(1).scaleb(-(column_type.scale or 0))), "f")
    if isinstance(column_type, DateTime):
        if isinstance(value, datetime):
            return _utc(value).isoformat(timespec="microseconds")
        return str(value)
    if isinstance(column_type, LargeBinary):
        return bytes(value).hex()
    if isinstance(column_type, JSON):
        return json.loads(canonical_json(value))
    return value


def _utc(moment: datetime) -> datetime:
    """`moment` in UTC; a naive datetime is taken to be UTC already."""
    if moment.utcoffset() is None:
        return moment.replace(tzinfo=UTC)
    return moment.astimezone(UTC)


def row_content(row: SQLModel) -> dict[str, Any]:
    """Every column of `row` as JSON values (datetimes ISO 8601, bytes hex, floats as floats)."""
    table = row.__table__  # type: ignore[attr-defined]
    return {c.name: _normalise(c.type, getattr(row, c.name)) for c in table.columns}


def row_key(row: SQLModel) -> Any:
    """The primary-key value of `row`, in its JSON form."""
    table = row.__table__  # type: ignore[attr-defined]
    (pk,) = table.primary_key.columns
    return _normalise(pk.type, getattr(row, pk.name))


def _table_name(row: SQLModel) -> str:
    return str(row.__table__.name)  # type: ignore[attr-defined]


def _from_v1(table: str, column: str, value: Any) -> Any:
    """A version-1 field in today's form: amounts were floats before they became exact decimals."""
    column_type = _COLUMN_TYPES.get((table, column))
    if value is None or column_type is None or not isinstance(column_type, Numeric):
        return value
    return _normalise(column_type, value)


def build_record(index: int, kind: str, changes: Sequence[RowChange]) -> bytes:
    """Canonical bytes of log entry `index` describing `changes` (record version 2: exact amounts
    as fixed-scale strings; version 1 wrote them as floats and is still verified)."""
    rows = []
    for row, columns in changes:
        content = row_content(row)
        fields = content if columns is None else {c: content[c] for c in columns}
        rows.append({"table": _table_name(row), "key": row_key(row), "fields": fields})
    record = {"v": RECORD_VERSION, "index": index, "kind": kind, "rows": rows}
    return canonical_json(record)


# --- appending ----------------------------------------------------------------------------------


def lock_log(session: Session) -> None:
    """Serialise writers for the rest of the current transaction.

    PostgreSQL: a transaction-level advisory lock, released at commit or rollback. SQLite: the
    transaction must hold the database's write lock from its first statement (BEGIN IMMEDIATE);
    a read transaction already under way is committed first and a write transaction begun.
    """
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": APPEND_LOCK_KEY})
        return
    if session.in_transaction():
        if session.connection().get_execution_options().get(IMMEDIATE, False):
            return
        session.commit()
    session.connection(execution_options={IMMEDIATE: True})


def log_size(session: Session) -> int:
    """Number of entries in the log."""
    last = session.exec(select(func.max(LogEntry.index))).one()
    return 0 if last is None else int(last) + 1


def append_entry(session: Session, *, kind: str, changes: Sequence[RowChange]) -> LogEntry:
    """Append one entry describing `changes` (already flushed rows) to the log.

    Takes the append lock, assigns the next index and adds the entry to the session without
    committing: the entry commits or rolls back with the rows it describes.
    """
    lock_log(session)
    session.flush()
    index = log_size(session)
    record = build_record(index, kind, changes)
    entry = LogEntry(index=index, kind=kind, record=record, leaf_hash=merkle.leaf_hash(record))
    session.add(entry)
    session.flush()
    return entry


# --- tree heads and proofs ----------------------------------------------------------------------


def leaf_hashes(session: Session, *, size: int) -> list[bytes]:
    """Cached leaf hashes of entries 0..size-1 (reads the hash column only, never the records)."""
    rows = session.exec(
        select(LogEntry.leaf_hash).where(col(LogEntry.index) < size).order_by(col(LogEntry.index))
    ).all()
    return [bytes(h) for h in rows]


def _checked_size(session: Session, size: int) -> int:
    current = log_size(session)
    if not 0 <= size <= current:
        raise ValueError(f"tree size {size} is outside 0..{current}")
    return current


def sign_head(session: Session, *, signer: Identity) -> Checkpoint:
    """Sign the tree head as the current transaction sees it and add it, without committing: the
    checkpoint commits with whatever the transaction wrote before it (e.g. a round's close)."""
    lock_log(session)
    session.flush()
    size = log_size(session)
    root_hex = merkle.root(leaf_hashes(session, size=size)).hex()
    signed_at = utcnow()
    message = checkpoint_message(size=size, root=root_hex, signed_at=signed_at)
    head = Checkpoint(
        size=size, root=root_hex, signature=signer.sign(message).hex(), signed_at=signed_at
    )
    session.add(head)
    session.flush()
    return head


def checkpoint(session: Session, *, signer: Identity) -> Checkpoint:
    """Sign the current tree head (size, RFC 9162 root) with `signer` and store it."""
    try:
        head = sign_head(session, signer=signer)
        session.commit()
    except BaseException:
        session.rollback()
        raise
    session.refresh(head)
    return head


def latest_checkpoint(session: Session) -> Checkpoint | None:
    """The most recent signed tree head, if any."""
    return session.exec(select(Checkpoint).order_by(col(Checkpoint.id).desc())).first()


def list_entries(session: Session, *, start: int = 0, limit: int = 100) -> list[LogEntry]:
    """Log entries start..start+limit-1, in index order."""
    return list(
        session.exec(
            select(LogEntry)
            .where(col(LogEntry.index) >= start)
            .order_by(col(LogEntry.index))
            .limit(limit)
        ).all()
    )


def _record_holds(session: Session, needle: bytes) -> ColumnElement[bool] | None:
    """SQL for "the entry's record holds `needle`" (None where no backend function is known)."""
    dialect = session.get_bind().dialect.name
    if dialect == "sqlite":
        return func.instr(LogEntry.record, needle) > 0
    if dialect == "postgresql":
        return func.position(literal(needle, LargeBinary).op("IN")(LogEntry.record)) > 0
    return None


def reward_entries(session: Session, *, contributor_id: str) -> dict[int, LogEntry]:
    """The log entries that recorded `contributor_id`'s rewards, by reward id.

    A reward entry's record holds the rewards row with every field, the contributor among them:
    a byte search in the canonical record narrows the scan (SQLite `instr`, PostgreSQL
    `position`), the parsed record decides.
    """
    query = select(LogEntry).where(LogEntry.kind == "reward").order_by(col(LogEntry.index))
    holds = _record_holds(session, canonical_json({"contributor_id": contributor_id})[1:-1])
    if holds is not None:
        query = query.where(holds)
    found: dict[int, LogEntry] = {}
    for entry in session.exec(query):
        for row in json.loads(bytes(entry.record)).get("rows", []):
            fields = row.get("fields", {})
            if row.get("table") == "rewards" and fields.get("contributor_id") == contributor_id:
                found.setdefault(int(row["key"]), entry)
    return found


@dataclass(frozen=True)
class InclusionProof:
    """RFC 9162 §2.1.3 audit path of leaf `index` in the tree of the first `tree_size` entries."""

    index: int
    tree_size: int
    leaf_hash: bytes
    path: tuple[bytes, ...]
    root: bytes

    def verify(self) -> bool:
        return merkle.verify_inclusion(
            self.index, self.tree_size, self.leaf_hash, self.path, self.root
        )


@dataclass(frozen=True)
class ConsistencyProof:
    """RFC 9162 §2.1.4 proof that the tree of `old_size` entries is a prefix of `new_size`."""

    old_size: int
    new_size: int
    old_root: bytes
    new_root: bytes
    path: tuple[bytes, ...]

    def verify(self) -> bool:
        return merkle.verify_consistency(
            self.old_size, self.new_size, self.old_root, self.new_root, self.path
        )


def get_inclusion_proof(session: Session, *, index: int, tree_size: int) -> InclusionProof:
    """Inclusion proof for entry `index` against the tree of the first `tree_size` entries."""
    _checked_size(session, tree_size)
    leaves = leaf_hashes(session, size=tree_size)
    path = merkle.inclusion_proof(index, leaves)
    return InclusionProof(index, tree_size, leaves[index], tuple(path), merkle.root(leaves))


def get_consistency_proof(session: Session, *, old_size: int, new_size: int) -> ConsistencyProof:
    """Consistency proof between the trees of the first `old_size` and `new_size` entries."""
    _checked_size(session, new_size)
    if not 0 <= old_size <= new_size:
        raise ValueError(f"old size {old_size} is outside 0..{new_size}")
    leaves = leaf_hashes(session, size=new_size)
    path = merkle.consistency_proof(old_size, leaves)
    return ConsistencyProof(
        old_size,
        new_size,
        merkle.root(leaves[:old_size]),
        merkle.root(leaves),
        tuple(path),
    )


# --- verification -------------------------------------------------------------------------------

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
