"""Repository functions on both backends."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import pytest
from sqlmodel import Session

from zoo_gym.core.identity import Identity
from zoo_gym.ledger import (
    AggregationDecision,
    ContributorKeyMismatch,
    ContributorPublic,
    DuplicateSubmission,
    LedgerError,
    NotFound,
    ReplayedNonce,
    RoundPublic,
    SubmissionPublic,
    list_entries,
    log_size,
    verify_ledger,
)
from zoo_gym.ledger import repository as repo

if TYPE_CHECKING:
    from conftest import Populated


def _submit(session: Session, who: str, nonce: str, decision: str = "accepted", number: int = 1):  # type: ignore[no-untyped-def]
    return repo.record_submission(
        session,
        round_number=number,
        contributor_id=who,
        nonce=nonce,
        base_version="v0000",
        payload_sha256="00" * 32,
        size_bytes=1,
        decision=decision,
        reason="test",
    )


def test_register_is_idempotent_for_the_same_key(session: Session) -> None:
    who = Identity.generate()
    first = repo.register_contributor(
        session, contributor_id=who.contributor_id, public_key=who.public_key, name="a"
    )
    size = log_size(session)
    again = repo.register_contributor(
        session, contributor_id=who.contributor_id, public_key=who.public_key, name="a"
    )
    assert again.contributor_id == first.contributor_id
    assert log_size(session) == size
    with pytest.raises(ContributorKeyMismatch):
        repo.register_contributor(
            session, contributor_id=who.contributor_id, public_key=b"\x01" * 32, name="a"
        )
    public = ContributorPublic.model_validate(first)
    assert public.public_key == who.public_key.hex()
    assert [c.contributor_id for c in repo.list_contributors(session)] == [who.contributor_id]


def test_round_lifecycle(session: Session) -> None:
    repo.open_round(
        session, number=1, base_version="v0000", seed=2**62, aggregator="median", codec="int8"
    )
    with pytest.raises(LedgerError):
        repo.open_round(session, number=1, base_version="v0000", seed=1, aggregator="m", codec="c")
    repo.set_round_status(session, number=1, status="aggregating")
    closed = repo.close_round(session, number=1, status="rolled_back", metrics={"utility": -1.0})
    assert closed.status == "rolled_back" and closed.closed_at is not None
    with pytest.raises(LedgerError):
        repo.close_round(session, number=1, status="published", metrics={})
    with pytest.raises(LedgerError):
        repo.set_round_status(session, number=1, status="published")
    with pytest.raises(NotFound):
        repo.set_round_status(session, number=2, status="aggregating")
    repo.open_round(session, number=2, base_version="v0000", seed=3, aggregator="m", codec="c")
    latest = repo.latest_round(session)
    assert latest is not None and latest.number == 2
    assert [r.number for r in repo.list_rounds(session)] == [1, 2]
    round_1 = repo.get_round(session, number=1)
    assert round_1 is not None
    assert RoundPublic.model_validate(round_1).metrics == {"utility": -1.0}
    assert round_1.seed == 2**62


def test_one_accepted_submission_per_round_and_no_replayed_nonce(session: Session) -> None:
    who = Identity.generate()
    cid = who.contributor_id
    repo.register_contributor(session, contributor_id=cid, public_key=who.public_key, name="a")
    repo.open_round(session, number=1, base_version="v0000", seed=1, aggregator="m", codec="c")
    _submit(session, cid, "n1", decision="rejected")
    _submit(session, cid, "n2")
    size = log_size(session)
    with pytest.raises(DuplicateSubmission):
        _submit(session, cid, "n3")
    with pytest.raises(ReplayedNonce):
        _submit(session, cid, "n1", decision="rejected")
    _submit(session, cid, "n4", decision="rejected")
    assert log_size(session) == size + 1
    assert [s.nonce for s in repo.list_submissions(session, contributor_id=cid)] == [
        "n1",
        "n2",
        "n4",
    ]
    assert verify_ledger(session, public_key=who.public_key).ok


def test_a_rounds_aggregation_decisions_are_recorded_together_or_not_at_all(
    session: Session,
) -> None:
    # Prepare: three contributors' accepted submissions and one rejected one
    repo.open_round(session, number=1, base_version="v0000", seed=1, aggregator="m", codec="c")
    ids = []
    for i in range(4):
        who = Identity.generate()
        repo.register_contributor(
            session, contributor_id=who.contributor_id, public_key=who.public_key, name=f"c{i}"
        )
        decision = "rejected" if i == 3 else "accepted"
        ids.append(_submit(session, who.contributor_id, f"n{i}", decision=decision).id)
    size = log_size(session)

    def decision(i: int, selected: bool) -> AggregationDecision:
        return AggregationDecision(ids[i], selected, 0.5 * selected, 0.0, None, f"row {i}")

    # Execute: a batch naming the rejected one changes nothing; then the round's three
    with pytest.raises(LedgerError, match=f"submission {ids[3]} was rejected"):
        repo.record_aggregations(
            session, decisions=[decision(0, True), decision(1, False), decision(3, True)]
        )
    assert log_size(session) == size
    assert [s.aggregation_reason for s in repo.list_submissions(session)] == [None] * 4
    recorded = repo.record_aggregations(
        session, decisions=[decision(0, True), decision(1, False), decision(2, True)]
    )

    # Assert: each row as decided, one log entry each, the chain verifies
    assert [(s.id, s.selected, s.weight, s.aggregation_reason) for s in recorded] == [
        (ids[0], True, 0.5, "row 0"),
        (ids[1], False, 0.0, "row 1"),
        (ids[2], True, 0.5, "row 2"),
    ]
    assert log_size(session) == size + 3
    assert verify_ledger(session, public_key=Identity.generate().public_key).ok


def test_a_recorded_submission_is_returned_as_stored_and_counted(session: Session) -> None:
    # Prepare
    who = Identity.generate()
    cid = who.contributor_id
    repo.register_contributor(session, contributor_id=cid, public_key=who.public_key, name="a")
    repo.open_round(session, number=1, base_version="v0000", seed=1, aggregator="m", codec="c")
    repo.open_round(session, number=2, base_version="v0000", seed=2, aggregator="m", codec="c")

    # Execute: two in round 1 (one rejected), one in round 2
    written = [
        _submit(session, cid, "n1", decision="rejected"),
        _submit(session, cid, "n2"),
        _submit(session, cid, "n3", number=2),
    ]

    # Assert: what each call returned is the row the database holds, field for field
    stored = repo.list_submissions(session, contributor_id=cid)
    assert [SubmissionPublic.model_validate(s) for s in written] == [
        SubmissionPublic.model_validate(s) for s in stored
    ]
    counts = [repo.count_submissions(session, round_number=n, contributor_id=cid) for n in (1, 2)]
    assert counts == [2, 1]
    assert repo.count_submissions(session, round_number=1, contributor_id="0" * 32) == 0
    assert verify_ledger(session, public_key=who.public_key).ok


def test_aggregation_decisions_read_in_chunks_change_exactly_their_rows(
    session: Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: five accepted submissions, read back two ids per SELECT
    monkeypatch.setattr(repo, "_IDS_PER_QUERY", 2)
    repo.open_round(session, number=1, base_version="v0000", seed=1, aggregator="m", codec="c")
    ids = []
    for i in range(5):
        who = Identity.generate()
        repo.register_contributor(
            session, contributor_id=who.contributor_id, public_key=who.public_key, name=f"c{i}"
        )
        ids.append(_submit(session, who.contributor_id, f"n{i}").id)
    size = log_size(session)
    order = [ids[4], ids[0], ids[3], ids[1], ids[2]]

    # Execute: decisions in another order than the ids
    recorded = repo.record_aggregations(
        session,
        decisions=[
            AggregationDecision(sid, k % 2 == 0, 0.25 * k, 0.5, float(k) if k else None, f"r{k}")
            for k, sid in enumerate(order)
        ],
    )

    # Assert: each row holds its own decision, one log entry each in the decisions' order
    assert [s.id for s in recorded] == order
    rows = {s.id: s for s in repo.list_submissions(session)}
    got = [
        (rows[sid].selected, rows[sid].weight, rows[sid].score, rows[sid].aggregation_reason)
        for sid in order
    ]
    assert got == [
        (True, 0.0, None, "r0"),
        (False, 0.25, 1.0, "r1"),
        (True, 0.5, 2.0, "r2"),
        (False, 0.75, 3.0, "r3"),
        (True, 1.0, 4.0, "r4"),
    ]
    assert all(rows[sid].trimmed_share == 0.5 for sid in ids)
    assert log_size(session) == size + 5
    keys = [json.loads(e.record)["rows"][0]["key"] for e in list_entries(session, start=size)]
    assert keys == order
    assert verify_ledger(session, public_key=Identity.generate().public_key).ok


def test_populated_ledger_reads_back(session: Session, populated: Populated) -> None:
    accepted, rejected = repo.list_submissions(session, round_number=1)
    assert (accepted.id, rejected.id) == (populated.accepted_id, populated.rejected_id)
    public = SubmissionPublic.model_validate(accepted)
    assert (public.selected, public.weight, public.score) == (True, 1.0, 0.25)
    assert (public.quality, public.reward, public.epsilon) == (0.125, 10.0, 2.5)
    alice = repo.get_contributor(session, contributor_id=populated.alice)
    bob = repo.get_contributor(session, contributor_id=populated.bob)
    assert alice is not None and alice.reputation == 0.5
    assert bob is not None and (bob.status, bob.status_reason) == ("banned", "spam")
    assert [c.contributor_id for c in repo.list_contributors(session, status="banned")] == [
        populated.bob
    ]
    (reward,) = repo.list_rewards(session, round_number=1)
    assert (reward.amount, reward.quality, reward.reputation_after) == (10.0, 0.125, 0.5)
    latest = repo.latest_model_version(session)
    assert latest is not None and latest.version == "v0001"
    assert [m.version for m in repo.list_model_versions(session)] == ["v0001"]
    assert [e.action for e in repo.list_audit(session)] == ["contributor.status", "policy.set"]
    with pytest.raises(LedgerError):
        repo.record_aggregation(
            session,
            submission_id=populated.rejected_id,
            selected=False,
            weight=0.0,
            trimmed_share=1.0,
            score=None,
            reason="x",
        )
    report = verify_ledger(session, public_key=populated.signer.public_key)
    assert report.ok, report.problems
    assert report.checkpoints == 1


def test_reopening_an_existing_database_keeps_its_rows(database_url: str, session: Session) -> None:
    from zoo_gym.ledger import open_database

    repo.open_round(session, number=5, base_version="v0004", seed=1, aggregator="m", codec="c")
    again = open_database(database_url)
    with Session(again) as other:
        assert repo.get_round(other, number=5) is not None
    again.dispose()
