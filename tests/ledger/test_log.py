"""The Merkle log in the database: records, checkpoints and proofs (RFC 9162 §2.1)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import pytest
from sqlmodel import Session

from zoo_gym.core import merkle
from zoo_gym.core.hashing import canonical_json
from zoo_gym.core.identity import Identity, verify
from zoo_gym.ledger import (
    LogEntryPublic,
    checkpoint,
    get_consistency_proof,
    get_inclusion_proof,
    latest_checkpoint,
    list_entries,
    log_size,
    reward_entries,
    verify_ledger,
)
from zoo_gym.ledger import repository as repo
from zoo_gym.ledger.log import checkpoint_message, leaf_hashes
from zoo_gym.ledger.models import Submission
from zoo_gym.ledger.records import Written, build_record

if TYPE_CHECKING:
    from conftest import Populated


def test_records_are_canonical_versioned_and_hashed(session: Session, populated: Populated) -> None:
    entries = list_entries(session, limit=1000)
    assert [e.index for e in entries] == list(range(len(entries)))
    for entry in entries:
        record = json.loads(entry.record)
        assert canonical_json(record) == entry.record
        assert (record["v"], record["index"], record["kind"]) == (2, entry.index, entry.kind)
        assert entry.leaf_hash == merkle.leaf_hash(entry.record)
    reward = json.loads(entries[populated.entries["reward"]].record)
    assert reward["rows"][0]["fields"]["amount"] == "10.000000000"  # exact, fixed scale
    assert LogEntryPublic.model_validate(entries[0]).leaf_hash == entries[0].leaf_hash.hex()


def test_checkpoint_is_signed_tree_head(session: Session, populated: Populated) -> None:
    head = latest_checkpoint(session)
    assert head is not None
    size = log_size(session)
    assert head.size == size
    assert head.root == merkle.root(leaf_hashes(session, size=size)).hex()
    message = checkpoint_message(size=head.size, root=head.root, signed_at=head.signed_at)
    assert verify(populated.signer.public_key, bytes.fromhex(head.signature), message)
    assert not verify(Identity.generate().public_key, bytes.fromhex(head.signature), message)


def test_proofs_verify_against_checkpoints(session: Session, populated: Populated) -> None:
    old = latest_checkpoint(session)
    assert old is not None
    for i in range(5):
        repo.record_audit(session, actor="op", action="note", target=str(i), detail={})
    new = checkpoint(session, signer=populated.signer)
    assert new.size == old.size + 5
    for index in range(new.size):
        proof = get_inclusion_proof(session, index=index, tree_size=new.size)
        assert proof.root.hex() == new.root
        assert proof.verify()
    for old_size in range(new.size + 1):
        consistency = get_consistency_proof(session, old_size=old_size, new_size=new.size)
        assert consistency.verify()
    between = get_consistency_proof(session, old_size=old.size, new_size=new.size)
    assert (between.old_root.hex(), between.new_root.hex()) == (old.root, new.root)
    with pytest.raises(ValueError):
        get_inclusion_proof(session, index=0, tree_size=new.size + 1)
    with pytest.raises(ValueError):
        get_consistency_proof(session, old_size=new.size, new_size=new.size - 1)
    assert verify_ledger(session, public_key=populated.signer.public_key).ok


def test_rejected_write_appends_nothing(session: Session, populated: Populated) -> None:
    size = log_size(session)
    with pytest.raises(repo.ReplayedNonce):
        repo.record_submission(
            session,
            round_number=1,
            contributor_id=populated.alice,
            nonce="a-1",
            base_version="v0000",
            payload_sha256="00",
            size_bytes=1,
            decision="rejected",
            reason="x",
        )
    assert log_size(session) == size
    assert verify_ledger(session, public_key=populated.signer.public_key).ok


def test_version_1_float_amounts_read_as_exact_decimals() -> None:
    # Records written before amounts became exact decimals still verify against migrated rows
    from zoo_gym.ledger.records import _from_v1

    assert _from_v1("rewards", "amount", 10.0) == "10.000000000"
    assert _from_v1("rewards", "amount", 0.1) == "0.100000000"
    assert _from_v1("rewards", "amount", 0.0) == "0.000000000"  # never "0E-9"
    assert _from_v1("submissions", "reward", None) is None
    assert _from_v1("rewards", "quality", 0.25) == 0.25  # floats stay floats
    assert _from_v1("contributors", "name", "alice") == "alice"


def test_reward_entries_are_the_contributors_reward_records(session: Session) -> None:
    alice, bob = Identity.generate().contributor_id, Identity.generate().contributor_id
    for who in (alice, bob):  # entries 0, 1
        repo.register_contributor(session, contributor_id=who, public_key=b"\x00" * 32, name="x")
    repo.open_round(session, number=1, base_version="v0", seed=1, aggregator="fedavg", codec="f32")
    paid = [  # entries 3, 4
        repo.record_reward(
            session, round_number=1, contributor_id=who, quality=0.5, amount=1, reputation_after=0.5
        )
        for who in (alice, bob)
    ]
    repo.open_round(session, number=2, base_version="v1", seed=2, aggregator="fedavg", codec="f32")
    repo.record_submission(  # entry 6
        session,
        round_number=2,
        contributor_id=alice,
        nonce="a-2",
        base_version="v1",
        payload_sha256="aa" * 32,
        size_bytes=1,
        decision="accepted",
        reason="ok",
    )
    paid.append(  # entry 7: the reward, alice's reputation and her submission's reward
        repo.record_reward(
            session,
            round_number=2,
            contributor_id=alice,
            quality=0.25,
            amount="2.5",
            reputation_after=0.75,
        )
    )
    # entry 8 holds alice's id in the same bytes, but is no reward
    repo.record_audit(
        session, actor="op", action="note", target=alice, detail={"contributor_id": alice}
    )

    def indices(who: str) -> dict[int, int]:
        return {key: e.index for key, e in reward_entries(session, contributor_id=who).items()}

    assert indices(alice) == {paid[0].id: 3, paid[2].id: 7}
    assert indices(bob) == {paid[1].id: 4}
    assert indices("0" * 64) == {}


def test_a_written_row_records_as_the_mapped_row_does() -> None:
    # Prepare: the same change as a mapped row and as the values a statement wrote
    values = {"selected": True, "weight": 0.125, "trimmed_share": 0.0, "score": None}
    fields = [*values, "aggregation_reason"]
    mapped = Submission(id=7, aggregation_reason="fedavg", **values)
    written = Written(Submission, {"id": 7, "aggregation_reason": "fedavg", **values})

    # Execute
    records = [build_record(3, "aggregation", [(row, fields)]) for row in (mapped, written)]

    # Assert: the same bytes, holding the key and exactly the named columns
    assert records[0] == records[1]
    (row,) = json.loads(records[1])["rows"]
    assert row == {
        "table": "submissions",
        "key": 7,
        "fields": {**values, "aggregation_reason": "fedavg"},
    }
