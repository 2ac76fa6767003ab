"""The append-only Merkle log behind every ledger row, and its signed checkpoints.

Each change a repository function makes is appended, in the same transaction, as one log entry
whose record (`zoo_gym.ledger.records`) describes the rows it wrote. Leaf i of the tree is
SHA-256(0x00 || record) and the tree is the Merkle tree of RFC 9162 §2.1 (`zoo_gym.core.merkle`).
A checkpoint is the signed tree head: an Ed25519 signature over canonical
{"v", "kind", "size", "root", "signed_at"}. Inclusion and consistency proofs are read from the
cached leaf hashes; `zoo_gym.ledger.verify` replays the whole log against the rows.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import ColumnElement, LargeBinary, func, insert, literal, text
from sqlmodel import Session, col, select

from zoo_gym.core import merkle
from zoo_gym.core.checkpoints import checkpoint_message as checkpoint_message
from zoo_gym.core.hashing import canonical_json
from zoo_gym.core.identity import Identity
from zoo_gym.ledger.db import IMMEDIATE
from zoo_gym.ledger.models import Checkpoint, LogEntry, utcnow
from zoo_gym.ledger.records import RowChange, build_record

# Key of the PostgreSQL transaction-level advisory lock that serialises appends ("zoolog").
APPEND_LOCK_KEY = 0x7A6F6F6C6F67


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


_LAST_INDEX = select(func.max(LogEntry.index))


def log_size(session: Session) -> int:
    """Number of entries in the log."""
    last = session.connection().execute(_LAST_INDEX).scalar()
    return 0 if last is None else int(last) + 1


def append_entry(session: Session, *, kind: str, changes: Sequence[RowChange]) -> int:
    """Append one entry describing `changes` (already flushed rows) to the log; its index.

    Takes the append lock, assigns the next index and writes the entry in the session's
    transaction without committing: the entry commits or rolls back with the rows it describes.
    """
    return append_entries(session, kind=kind, changes=[changes])


def append_entries(session: Session, *, kind: str, changes: Sequence[Sequence[RowChange]]) -> int:
    """Append one entry of `kind` per item of `changes` (rows already written), in order, with
    one INSERT, as `append_entry` appends one; the index of the first."""
    lock_log(session)
    session.flush()
    first = log_size(session)
    entries = []
    for index, rows in enumerate(changes, start=first):
        record = build_record(index, kind, rows)
        entries.append(
            {"index": index, "kind": kind, "record": record, "leaf_hash": merkle.leaf_hash(record)}
        )
    if entries:
        session.connection().execute(insert(LogEntry), entries)
    return first


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
