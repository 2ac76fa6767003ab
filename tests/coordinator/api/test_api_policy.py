"""Policy changes are validated by the config model, staged for the next round and audited."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from zoo_gym import ledger

if TYPE_CHECKING:
    from api_world import World


def patch(world: World, body: dict[str, Any]) -> Any:
    return world.client.patch("/policy", json=body, headers=world.as_admin)


def test_change_is_staged_for_the_next_round_and_audited(world: World) -> None:
    # Execute
    first = patch(world, {"aggregator": "trimmed_mean", "byzantine_f": 1, "min_clients": 3})
    second = patch(
        world,
        {"training": {"clip_norm": 1.5}, "training.codec": "int8", "quality_gate_tolerance": 0.05},
    )

    # Assert: the running policy is unchanged, the staged one has both changes
    assert first.status_code == 200, first.text
    assert second.status_code == 200, second.text
    body = second.json()
    assert body["current"]["aggregator"] == "median" and body["next_round"] == 2
    assert body["pending"]["aggregator"] == "trimmed_mean"
    assert body["pending"]["training"]["clip_norm"] == 1.5
    assert body["pending_changes"]["training.codec"] == {"old": "bitdelta", "new": "int8"}
    assert set(body["pending_changes"]) == {
        "aggregator",
        "byzantine_f",
        "min_clients",
        "training.clip_norm",
        "training.codec",
        "quality_gate_tolerance",
    }
    with world.session() as s:
        events = ledger.list_audit(s, target="policy")
    assert [e.action for e in events] == ["policy.update", "policy.update"]
    assert events[0].detail["changes"]["aggregator"] == {"old": "median", "new": "trimmed_mean"}
    assert events[1].detail["from_round"] == 2 and events[1].actor.startswith("apikey:ops/")

    # the round loop takes it once
    change = world.control.take_policy()
    assert change is not None and change.config.aggregator == "trimmed_mean"
    assert change.config.training.codec == "int8" and change.config.listen == world.co.config.listen
    assert world.control.take_policy() is None


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"aggregator": "nope"}, "aggregator must be one of"),
        ({"byzantine_f": -1}, "byzantine_f: Input should be greater than or equal to 0"),
        ({"training": {"codec": "zip"}}, "codec must be one of"),
        ({"training.clip_norm": "big"}, "training.clip_norm: Input should be a valid number"),
        ({"aggregator": "krum", "byzantine_f": 2}, "needs at least"),
        ({"listen": "0.0.0.0:1"}, "listen is not a policy setting"),
        ({"reward": 1}, "reward is not a setting"),
        ({}, "the change is empty"),
    ],
)
def test_bad_values_are_refused_with_one_clear_line(
    world: World, body: dict[str, Any], message: str
) -> None:
    response = patch(world, body)
    assert response.status_code == 400
    assert message in response.json()["detail"]
    assert world.control.pending_policy() is None
    with world.session() as s:
        assert ledger.list_audit(s, target="policy") == []


def test_viewer_reads_policy(world: World) -> None:
    body = world.client.get("/policy", headers=world.as_viewer).json()
    assert body["pending"] is None and body["current"]["aggregator"] == "median"
    assert "training.clip_norm" in body["settable"] and "listen" not in body["settable"]
