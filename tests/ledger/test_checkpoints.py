"""Rollback and fork of the log, caught against checkpoints kept outside the database.

The finding reproduced: delete the newest signed checkpoint, rewrite an entry recorded after the
one left (record, leaf hash and row, consistently), and the database agrees with itself. What is
left to catch it: the checkpoint schedule (one at each round's end) and checkpoints kept elsewhere.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from sqlalchemy import text
from sqlmodel import Session

from zoo_gym.core import merkle
from zoo_gym.core.checkpoints import parse_checkpoints
from zoo_gym.core.hashing import canonical_json
from zoo_gym.core.identity import Identity
from zoo_gym.ledger import (
    CheckpointFileError,
    SignedCheckpoint,
    append_checkpoint,
    checkpoint,
    get_consistency_proof,
    latest_checkpoint,
    list_entries,
    log_size,
    read_checkpoints,
    verify_ledger,
)
from zoo_gym.ledger import repository as repo

if TYPE_CHECKING:
    from conftest import Populated


@dataclass
class TwoRounds:
    """`populated` plus a second published round paying alice, each round ending in a checkpoint
    kept outside the database too."""

    signer: Identity
    first: SignedCheckpoint
    second: SignedCheckpoint
    second_id: int
    reward_index: int  # alice's round-2 reward, recorded after the first checkpoint


@pytest.fixture
def two_rounds(session: Session, populated: Populated) -> TwoRounds:
    signer = populated.signer
    first = checkpoint(session, signer=signer)
    repo.open_round(
        session, number=2, base_version="v0001", seed=8, aggregator="krum", codec="bitdelta"
    )
    reward = repo.record_reward(
        session,
        round_number=2,
        contributor_id=populated.alice,
        quality=0.25,
        amount=20,
        reputation_after=0.6,
    )
    repo.close_round(session, number=2, status="published", metrics={"loss": 1.25})
    second = checkpoint(session, signer=signer)
    assert second.id is not None
    return TwoRounds(
        signer,
        SignedCheckpoint.of(first, signer.public_key),
        SignedCheckpoint.of(second, signer.public_key),
        second.id,
        reward_entry(session, reward.id),
    )


def reward_entry(session: Session, reward_id: object) -> int:
    """Index of the log entry that recorded reward `reward_id`."""
    for entry in list_entries(session, limit=1000):
        rows = json.loads(bytes(entry.record))["rows"]
        if any(r["table"] == "rewards" and r["key"] == reward_id for r in rows):
            return entry.index
    raise LookupError(f"no entry for reward {reward_id!r}")


def sql(session: Session, statement: str, **params: object) -> None:
    session.execute(text(statement), params)
    session.commit()


def rewrite_reward(session: Session, index: int, amount: str) -> None:
    """Rewrite the reward of entry `index` everywhere: its record, its leaf hash and its row."""
    (raw,) = session.execute(
        text('SELECT record FROM log_entries WHERE "index" = :i'), {"i": index}
    ).one()
    record = json.loads(bytes(raw))
    (row,) = [r for r in record["rows"] if r["table"] == "rewards"]
    row["fields"]["amount"] = amount
    forged = canonical_json(record)
    session.execute(
        text('UPDATE log_entries SET record = :r, leaf_hash = :h WHERE "index" = :i'),
        {"r": forged, "h": merkle.leaf_hash(forged), "i": index},
    )
    sql(session, "UPDATE rewards SET amount = :a WHERE id = :k", a=amount, k=row["key"])


def roll_back(session: Session, run: TwoRounds) -> None:
    """The attack: delete the newest checkpoint, rewrite an entry recorded after the one left."""
    sql(session, "DELETE FROM checkpoints WHERE id = :id", id=run.second_id)
    rewrite_reward(session, run.reward_index, "0.000000000")


def test_kept_checkpoints_of_an_untouched_log_verify(
    session: Session, two_rounds: TwoRounds
) -> None:
    report = verify_ledger(
        session, public_key=two_rounds.signer.public_key, kept=[two_rounds.first, two_rounds.second]
    )
    assert report.ok, report.problems
    assert (report.kept, report.covered, report.uncovered) == (2, two_rounds.second.size, 0)


def test_rollback_is_a_missing_scheduled_checkpoint_in_the_database(
    session: Session, two_rounds: TwoRounds
) -> None:
    # Execute
    roll_back(session, two_rounds)
    report = verify_ledger(session, public_key=two_rounds.signer.public_key)

    # Assert: round 2 ended published, and no checkpoint covers its close any more
    first = report.first
    assert first is not None and (first.source, first.kind) == ("checkpoint", "round_close")
    assert "round 2 ended (published) but no checkpoint covers it" in first.detail
    assert report.covered == two_rounds.first.size


def test_rollback_resigned_passes_alone_but_not_against_a_kept_checkpoint(
    session: Session, two_rounds: TwoRounds
) -> None:
    # Prepare: the rewritten log is signed again, as a coordinator would at its next round
    roll_back(session, two_rounds)
    checkpoint(session, signer=two_rounds.signer)
    key = two_rounds.signer.public_key

    # Execute
    alone = verify_ledger(session, public_key=key)
    kept = verify_ledger(session, public_key=key, kept=[two_rounds.first, two_rounds.second])

    # Assert: the database agrees with itself; the kept second checkpoint does not
    assert alone.ok, alone.problems
    assert [str(p) for p in kept.problems] == [
        f"kept: no entry (checkpoint): kept {two_rounds.second.describe()}, but the log's tree of "
        f"that size has root {merkle_root_now(session, two_rounds.second.size)[:16]}…: an entry "
        f"before {two_rounds.second.size} was rewritten (the log forked)",
        f"kept: no entry (checkpoint): kept {two_rounds.second.describe()} is missing from the "
        "database: its row was deleted",
    ]


def merkle_root_now(session: Session, size: int) -> str:
    from zoo_gym.ledger.log import leaf_hashes

    return merkle.root(leaf_hashes(session, size=size)).hex()


def test_a_deleted_checkpoint_row_alone_is_caught(session: Session, two_rounds: TwoRounds) -> None:
    sql(session, "DELETE FROM checkpoints WHERE id = :id", id=two_rounds.second_id)
    checkpoint(session, signer=two_rounds.signer)
    report = verify_ledger(
        session, public_key=two_rounds.signer.public_key, kept=[two_rounds.second]
    )
    assert report.first is not None and "is missing from the database" in report.first.detail


def test_a_log_that_shrank_below_a_kept_checkpoint(session: Session, two_rounds: TwoRounds) -> None:
    # Prepare: everything after the first checkpoint deleted, the second checkpoint too
    sql(session, "DELETE FROM checkpoints WHERE id = :id", id=two_rounds.second_id)
    sql(session, 'DELETE FROM log_entries WHERE "index" >= :n', n=two_rounds.first.size)

    # Execute
    report = verify_ledger(
        session, public_key=two_rounds.signer.public_key, kept=[two_rounds.second]
    )

    # Assert
    first = report.first
    assert first is not None and (first.source, first.index) == ("kept", two_rounds.first.size)
    assert first.detail.endswith(
        f"but the log holds only {two_rounds.first.size} entries: the log shrank"
    )


def test_a_kept_checkpoint_signed_by_another_key(session: Session, two_rounds: TwoRounds) -> None:
    other = Identity.generate()
    with Session(session.get_bind()) as s:
        forged = SignedCheckpoint.of(checkpoint(s, signer=other), other.public_key)
    report = verify_ledger(session, public_key=two_rounds.signer.public_key, kept=[forged])
    assert any(p.source == "kept" and "signed by another key" in p.detail for p in report.problems)


def test_consistency_proofs_hold_until_the_rollback(
    session: Session, two_rounds: TwoRounds
) -> None:
    old, new = two_rounds.first, two_rounds.second

    before = get_consistency_proof(session, old_size=old.size, new_size=new.size)
    roll_back(session, two_rounds)
    after = get_consistency_proof(session, old_size=old.size, new_size=new.size)

    assert before.verify() and before.old_root.hex() == old.root
    assert before.new_root.hex() == new.root
    # the rewritten entry lies after the first checkpoint: that prefix still holds, the tree the
    # second checkpoint signed does not
    assert after.verify() and after.old_root.hex() == old.root
    assert after.new_root.hex() != new.root
    assert not merkle.verify_consistency(
        old.size, new.size, bytes.fromhex(old.root), bytes.fromhex(new.root), after.path
    )


def test_a_round_closed_with_a_signer_is_covered_in_the_same_transaction(
    session: Session, populated: Populated
) -> None:
    repo.open_round(session, number=2, base_version="v0001", seed=8, aggregator="krum", codec="bd")
    closed = repo.close_round(
        session, number=2, status="rolled_back", metrics={}, signer=populated.signer
    )
    head = latest_checkpoint(session)
    assert closed.status == "rolled_back" and head is not None
    assert head.size == log_size(session)  # the close is the last entry it covers
    assert verify_ledger(session, public_key=populated.signer.public_key).ok


def test_a_round_aborted_by_a_restart_needs_no_checkpoint(
    session: Session, populated: Populated
) -> None:
    repo.open_round(session, number=2, base_version="v0001", seed=8, aggregator="krum", codec="bd")
    repo.close_round(session, number=2, status="aborted", metrics={"reason": "restarted"})
    report = verify_ledger(session, public_key=populated.signer.public_key)
    assert report.ok, report.problems
    assert report.uncovered == 2 and report.covered == log_size(session) - 2


# --- the portable form and checkpoint files -----------------------------------------------------


def test_json_form_round_trips_and_verifies(session: Session, two_rounds: TwoRounds) -> None:
    line = two_rounds.second.line()
    back = SignedCheckpoint.from_json(json.loads(line))
    assert back == two_rounds.second and back.signed_by(two_rounds.signer.public_key)
    assert json.loads(line)["v"] == 1 and "\n" not in line


def test_copy_file_gets_one_line_per_checkpoint(tmp_path: Path, two_rounds: TwoRounds) -> None:
    copy = tmp_path / "checkpoints.jsonl"
    append_checkpoint(copy, two_rounds.first)
    append_checkpoint(copy, two_rounds.second)
    assert read_checkpoints(copy) == [two_rounds.first, two_rounds.second]
    assert len(copy.read_text().splitlines()) == 2


def test_one_pretty_printed_checkpoint_or_a_list_reads_too(two_rounds: TwoRounds) -> None:
    one = json.dumps(two_rounds.first.to_json(), indent=2)
    both = json.dumps([two_rounds.first.to_json(), two_rounds.second.to_json()])
    assert parse_checkpoints(one, source="x") == [two_rounds.first]
    assert parse_checkpoints(both, source="x") == [two_rounds.first, two_rounds.second]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "x holds no checkpoint"),
        ('{"size": 1}\n', "x: the checkpoint has no 'root'"),
        (
            '{"size":1,"root":"aa","signed_at":"2026-01-01T00:00:00","signature":"aa"}\nnope\n',
            "x line 2",
        ),
        ('{"size":-1,"root":"aa","signed_at":"t","signature":"aa"}', "size -1 is not a whole"),
        ('{"size":1,"root":"zz","signed_at":"t","signature":"aa"}', "root 'zz' is not hex"),
        ('{"size":1,"root":"aa","signed_at":"soon","signature":"aa"}', "'soon' is not an ISO"),
    ],
)
def test_malformed_checkpoint_files_name_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(CheckpointFileError, match=re.escape(message)):
        parse_checkpoints(text, source="x")


def test_an_unreadable_file_is_one_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointFileError, match=r"cannot read .*missing\.jsonl"):
        read_checkpoints(tmp_path / "missing.jsonl")
