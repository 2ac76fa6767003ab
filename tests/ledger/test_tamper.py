"""Editing, deleting or reordering rows behind the ledger's back is detected and located."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from sqlalchemy import text
from sqlmodel import Session

from zoo_gym.core import merkle
from zoo_gym.core.hashing import canonical_json
from zoo_gym.ledger import verify_ledger
from zoo_gym.ledger.verify import VerifyReport

if TYPE_CHECKING:
    from conftest import Populated


def tamper(session: Session, sql: str, **params: Any) -> None:
    session.execute(text(sql), params)
    session.commit()


def check(session: Session, populated: Populated) -> VerifyReport:
    return verify_ledger(session, public_key=populated.signer.public_key)


def entry(session: Session, index: int) -> tuple[bytes, bytes]:
    record, leaf = session.execute(
        text('SELECT record, leaf_hash FROM log_entries WHERE "index" = :i'), {"i": index}
    ).one()
    return bytes(record), bytes(leaf)


def test_untouched_ledger_verifies(session: Session, populated: Populated) -> None:
    report = check(session, populated)
    assert report.ok and report.first is None
    assert report.size > 10 and report.checkpoints == 1


def test_edited_submission_decision(session: Session, populated: Populated) -> None:
    tamper(
        session,
        "UPDATE submissions SET decision = 'accepted' WHERE id = :id",
        id=populated.rejected_id,
    )
    first = check(session, populated).first
    assert first is not None
    assert (first.source, first.index, first.kind) == (
        "row",
        populated.entries["rejected"],
        "submission",
    )
    assert "decision is 'accepted'" in first.detail


def test_edited_reward_amount(session: Session, populated: Populated) -> None:
    tamper(session, "UPDATE rewards SET amount = 1000 WHERE contributor_id = :c", c=populated.alice)
    first = check(session, populated).first
    assert first is not None
    assert (first.index, first.kind) == (populated.entries["reward"], "reward")
    assert "amount" in first.detail


def test_edited_aggregation_outcome(session: Session, populated: Populated) -> None:
    tamper(session, "UPDATE submissions SET weight = 0.5 WHERE id = :id", id=populated.accepted_id)
    first = check(session, populated).first
    assert first is not None
    assert (first.index, first.kind) == (populated.entries["aggregation"], "aggregation")


def test_deleted_submission_row(session: Session, populated: Populated) -> None:
    tamper(session, "DELETE FROM submissions WHERE id = :id", id=populated.rejected_id)
    first = check(session, populated).first
    assert first is not None
    assert (first.index, first.kind) == (populated.entries["rejected"], "submission")
    assert "deleted" in first.detail


def test_row_inserted_without_log_entry(session: Session, populated: Populated) -> None:
    tamper(
        session,
        "INSERT INTO audit_events (actor, action, target, detail, at) "
        "VALUES ('x', 'y', 'z', '{}', CURRENT_TIMESTAMP)",
    )
    first = check(session, populated).first
    assert first is not None
    assert (first.source, first.index, first.kind) == ("row", None, "audit_events")


def test_edited_log_record(session: Session, populated: Populated) -> None:
    index = populated.entries["reward"]
    record, _ = entry(session, index)
    forged = record.replace(b'"amount":"10.000000000"', b'"amount":"99.000000000"')
    assert forged != record
    tamper(session, 'UPDATE log_entries SET record = :r WHERE "index" = :i', r=forged, i=index)
    first = check(session, populated).first
    assert first is not None
    assert (first.source, first.index, first.kind) == ("log", index, "reward")
    assert "leaf hash" in first.detail


def test_rewritten_log_record_and_row_break_the_checkpoint(
    session: Session, populated: Populated
) -> None:
    index = populated.entries["reward"]
    record, _ = entry(session, index)
    forged = record.replace(b'"amount":"10.000000000"', b'"amount":"99.000000000"')
    assert forged != record
    tamper(
        session,
        'UPDATE log_entries SET record = :r, leaf_hash = :h WHERE "index" = :i',
        r=forged,
        h=merkle.leaf_hash(forged),
        i=index,
    )
    tamper(session, "UPDATE rewards SET amount = 99 WHERE contributor_id = :c", c=populated.alice)
    report = check(session, populated)
    assert not report.ok
    assert [p.source for p in report.problems] == ["checkpoint"]
    assert "root differs" in report.problems[0].detail


def test_deleted_log_entry(session: Session, populated: Populated) -> None:
    index = populated.entries["aggregation"]
    tamper(session, 'DELETE FROM log_entries WHERE "index" = :i', i=index)
    first = check(session, populated).first
    assert first is not None
    assert (first.source, first.index, first.kind) == ("log", index, "missing")


def test_reordered_log_entries(session: Session, populated: Populated) -> None:
    a, b = populated.entries["accepted"], populated.entries["rejected"]
    (rec_a, leaf_a), (rec_b, leaf_b) = entry(session, a), entry(session, b)
    swap = 'UPDATE log_entries SET record = :r, leaf_hash = :h WHERE "index" = :i'
    session.execute(text(swap), {"r": rec_b, "h": leaf_b, "i": a})
    session.execute(text(swap), {"r": rec_a, "h": leaf_a, "i": b})
    session.commit()
    first = check(session, populated).first
    assert first is not None
    assert (first.source, first.index) == ("log", min(a, b))
    assert "moved" in first.detail


def test_reordered_rows(session: Session, populated: Populated) -> None:
    # Swap the payload digests of the two submissions: every row still exists, in the wrong place.
    tamper(
        session,
        "UPDATE submissions SET payload_sha256 = CASE WHEN id = :a THEN :pb ELSE :pa END "
        "WHERE id IN (:a, :b)",
        a=populated.accepted_id,
        b=populated.rejected_id,
        pa="aa" * 32,
        pb="bb" * 32,
    )
    first = check(session, populated).first
    assert first is not None
    assert first.index == min(populated.entries["accepted"], populated.entries["rejected"])
    assert "payload_sha256" in first.detail


def test_edited_record_renumbered_consistently_is_still_caught(
    session: Session, populated: Populated
) -> None:
    # Rewrite a record so it claims a different kind, recomputing the hash: the entry's own kind
    # column and the checkpoint both disagree.
    index = populated.entries["model_version"]
    record = json.loads(entry(session, index)[0])
    record["kind"] = "audit"
    forged = canonical_json(record)
    tamper(
        session,
        'UPDATE log_entries SET record = :r, leaf_hash = :h WHERE "index" = :i',
        r=forged,
        h=merkle.leaf_hash(forged),
        i=index,
    )
    first = check(session, populated).first
    assert first is not None
    assert (first.source, first.index) == ("log", index)


def test_forged_checkpoint(session: Session, populated: Populated) -> None:
    tamper(session, "UPDATE checkpoints SET size = size - 1")
    report = check(session, populated)
    assert not report.ok
    assert any("signature does not verify" in p.detail for p in report.problems)
