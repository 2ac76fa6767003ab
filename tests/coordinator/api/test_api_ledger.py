"""Checkpoints and proofs from the API verify with the RFC 9162 verifiers against the root."""

from __future__ import annotations

from typing import TYPE_CHECKING

from zoo_gym import ledger
from zoo_gym.core import merkle
from zoo_gym.core.identity import verify
from zoo_gym.ledger.log import checkpoint_message

if TYPE_CHECKING:
    from api_world import World

from api_world import sign_in


def test_checkpoint_on_demand_is_signed(world: World) -> None:
    # Execute
    before = world.client.get("/ledger/checkpoint", headers=world.as_viewer)
    created = world.client.post("/ledger/checkpoint", headers=world.as_admin)
    latest = world.client.get("/ledger/checkpoint", headers=world.as_viewer)

    # Assert
    assert before.status_code == 404
    assert created.status_code == 201 and latest.json() == created.json()
    head = created.json()
    with world.session() as s:
        assert head["size"] == ledger.log_size(s)
        row = ledger.latest_checkpoint(s)
        assert row is not None
        message = checkpoint_message(size=row.size, root=row.root, signed_at=row.signed_at)
    assert head["public_key"] == world.co.signer.public_key.hex()
    assert verify(bytes.fromhex(head["public_key"]), bytes.fromhex(head["signature"]), message)


def test_inclusion_proofs_verify_against_the_checkpoint_root(world: World) -> None:
    # Prepare
    head = world.client.post("/ledger/checkpoint", headers=world.as_admin).json()
    root = bytes.fromhex(head["root"])
    token = sign_in(world.client, world.alice)  # contributors may fetch proofs

    for index in range(head["size"]):
        # Execute
        proof = world.client.get(
            "/ledger/proofs/inclusion", params={"index": index}, headers=world.auth(token)
        ).json()

        # Assert
        assert proof["tree_size"] == head["size"] and bytes.fromhex(proof["root"]) == root
        path = [bytes.fromhex(p) for p in proof["path"]]
        assert merkle.verify_inclusion(
            index, head["size"], bytes.fromhex(proof["leaf_hash"]), path, root
        )
        assert not merkle.verify_inclusion(index, head["size"], b"\0" * 32, path, root)


def test_inclusion_proof_leaf_is_the_entry_record(shared_world: World) -> None:
    w = shared_world
    entries = w.client.get(
        "/ledger/entries", params={"start": 2, "limit": 3}, headers=w.as_viewer
    ).json()
    assert [e["index"] for e in entries["entries"]] == [2, 3, 4] and entries["size"] > 5
    entry = entries["entries"][0]
    proof = w.client.get(
        "/ledger/proofs/inclusion",
        params={"index": 2, "tree_size": entries["size"]},
        headers=w.as_viewer,
    ).json()
    assert (
        proof["leaf_hash"] == merkle.leaf_hash(entry["record"].encode()).hex() == entry["leaf_hash"]
    )


def test_consistency_between_two_checkpoints(world: World) -> None:
    # Prepare
    old = world.client.post("/ledger/checkpoint", headers=world.as_admin).json()
    world.client.post(
        f"/contributors/{world.bob.contributor_id}/ban",
        json={"reason": "x"},
        headers=world.as_admin,
    )
    new = world.client.post("/ledger/checkpoint", headers=world.as_admin).json()

    # Execute
    proof = world.client.get(
        "/ledger/proofs/consistency", params={"old_size": old["size"]}, headers=world.as_viewer
    ).json()

    # Assert
    assert (proof["old_size"], proof["new_size"]) == (old["size"], new["size"])
    assert (proof["old_root"], proof["new_root"]) == (old["root"], new["root"])
    path = [bytes.fromhex(p) for p in proof["path"]]
    assert merkle.verify_consistency(
        old["size"], new["size"], bytes.fromhex(old["root"]), bytes.fromhex(new["root"]), path
    )


def test_proofs_outside_the_log_are_refused(shared_world: World) -> None:
    w = shared_world
    beyond = w.client.get("/ledger/proofs/inclusion", params={"index": 10_000}, headers=w.as_viewer)
    too_big = w.client.get(
        "/ledger/proofs/consistency",
        params={"old_size": 1, "new_size": 10_000},
        headers=w.as_viewer,
    )
    assert beyond.status_code == 400 and "not in a tree of size" in beyond.json()["detail"]
    assert too_big.status_code == 400 and "outside" in too_big.json()["detail"]
