"""`/health` and `zoo_gym_round_loop_up` follow the round loop: ok while it runs or waits, 503
with the reason once it crashed or stopped. The loop here is the real one over the gRPC Grid,
whose contributor registry fails."""

from __future__ import annotations

from pathlib import Path

from fastapi.testclient import TestClient

from zoo_gym.coordinator.api.app import create_app
from zoo_gym.coordinator.config import load_config
from zoo_gym.coordinator.liveness import LoopHealth
from zoo_gym.coordinator.serve import api_services, run_loop
from zoo_gym.coordinator.service import Coordinator
from zoo_gym.transport.grid import GrpcGrid
from zoo_gym.transport.mailbox import Mailbox


class LostRegistry(Mailbox):
    def online(self) -> list[int]:
        raise RuntimeError("the node registry is gone\nsecond line")


def test_crashed_round_loop_answers_503_with_its_reason(tiny_home: Path) -> None:
    # Prepare
    co = Coordinator(load_config(tiny_home / "coordinator.toml"))
    client = TestClient(create_app(api_services(co)))
    before = client.get("/health")
    co.control.pause(by="ops")
    paused = client.get("/health").json()

    # Execute
    co.control.resume(by="ops")
    run_loop(co, GrpcGrid(LostRegistry()))
    after = client.get("/health")

    # Assert
    assert before.status_code == 200
    assert before.json()["status"] == "ok" and before.json()["round_loop"] == "starting"
    assert paused["paused"] is True and paused["status"] == "ok"
    assert after.status_code == 503
    body = after.json()
    assert body["status"] == "unavailable" and body["round_loop"] == "crashed"
    assert body["reason"] == "round loop crashed: RuntimeError: the node registry is gone"
    assert "zoo_gym_round_loop_up 0.0" in co.metrics.exposition().decode()


def test_stopping_is_not_undone_by_the_loop_winding_down() -> None:
    health = LoopHealth()
    health.set("running")

    health.set("stopping", "coordinator stopping")
    health.set("finished", "3 rounds done")

    assert health.status().state == "stopping" and not health.status().healthy
    health.set("crashed", "round loop crashed: ValueError: x")
    assert health.status().state == "crashed"
