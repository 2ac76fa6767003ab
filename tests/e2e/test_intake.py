"""Intake against a real `serve` with its default limits: NaN and Inf scales, a codec other than
the round's and a +-1e4 update are refused with their reason in the ledger, while an honest
update in the same round is accepted."""

from __future__ import annotations

import hashlib
import json
import sqlite3
import struct
import threading
import time
from pathlib import Path

import pytest
import torch
from serve_process import serve

from zoo_gym.client.runtime import signed_reply
from zoo_gym.compression import CodecSpec, encode, inspect_envelope
from zoo_gym.coordinator.config import load_config
from zoo_gym.coordinator.registry import ModelRegistry
from zoo_gym.coordinator.rounds import update_layout
from zoo_gym.core.delta import Layout
from zoo_gym.core.identity import Identity
from zoo_gym.core.lora import LoraSpec
from zoo_gym.core.protocol import TASK_CONFIG, TaskConfig
from zoo_gym.simulation.demo import Federation
from zoo_gym.transport.client import FederationClient, ReceivedTask

pytestmark = pytest.mark.e2e

FLOAT16_NAN, FLOAT16_INF = 0x7E00, 0x7C00


def round_layout(home: Path) -> Layout:
    """The tensors the coordinator's rounds train (the B matrices of the tiny model)."""
    config = load_config(home / "coordinator.toml")
    registry = ModelRegistry(config.path("models"), Identity.generate())
    state = registry.load_state_dict(registry.latest().version)
    t = config.training
    spec = LoraSpec(rank=t.lora_rank, alpha=t.lora_alpha, target_modules=tuple(t.target_modules))
    return update_layout(state, spec, t.adapter)  # type: ignore[arg-type]


def with_first_scale(payload: bytes, bits: int) -> bytes:
    """`payload` with its first float16 scale replaced by `bits`, re-hashed as a sender would."""
    header = inspect_envelope(payload, max_elements=1 << 30)
    offset = header.sections[0].scales_offset
    body = payload[:offset] + struct.pack("<H", bits) + payload[offset + 2 : -32]
    return body + hashlib.sha256(body).digest()


def payloads(layout: Layout, task: TaskConfig) -> dict[str, bytes]:
    spec = CodecSpec(task.codec, task.group_size, task.granularity)
    honest = encode({s.name: 0.01 * torch.randn(s.shape) for s in layout}, spec)
    return {
        "honest": honest,
        "nan": with_first_scale(honest, FLOAT16_NAN),
        "inf": with_first_scale(honest, FLOAT16_INF),
        "int8": encode({s.name: 0.01 * torch.randn(s.shape) for s in layout}, CodecSpec("int8")),
        "huge": encode({s.name: 1e4 * torch.randn(s.shape).sign() for s in layout}, spec),
    }


def wait_for_task(client: FederationClient, tasks: dict[str, ReceivedTask], name: str) -> None:
    deadline = time.monotonic() + 120
    while name not in tasks and time.monotonic() < deadline:
        task = client.poll(5.0)
        if task is not None:
            tasks[name] = task


def test_intake_refuses_non_finite_wrong_codec_and_oversized_updates(tiny_home: Path) -> None:
    # Prepare: five contributors in one round of a coordinator with default limits
    layout = round_layout(tiny_home)
    names = ("honest", "nan", "inf", "int8", "huge")
    identities = {name: Identity.generate() for name in names}
    with serve(tiny_home, min_clients=len(names), rounds=1) as served:
        clients = {n: FederationClient(served.address, identities[n], timeout_s=30) for n in names}
        for name, client in clients.items():
            client.register(name)
        tasks: dict[str, ReceivedTask] = {}
        polls = [
            threading.Thread(target=wait_for_task, args=(c, tasks, n)) for n, c in clients.items()
        ]
        for thread in polls:
            thread.start()
        for thread in polls:
            thread.join()
        assert sorted(tasks) == sorted(names)
        config = TaskConfig.from_record(tasks["honest"].message.content.config_records[TASK_CONFIG])
        bodies = payloads(layout, config)

        # Execute: each sends its envelope for its own task
        results = {
            n: clients[n].submit(
                tasks[n],
                signed_reply(
                    identities[n], tasks[n].message, config, bodies[n], {"num_examples": 8.0}
                ),
            )
            for n in names
        }
        summary_file = served.home / "rounds.jsonl"
        deadline = time.monotonic() + 120
        while not summary_file.exists() and time.monotonic() < deadline:
            time.sleep(0.5)
        for client in clients.values():
            client.close()

    # Assert: only the honest update was accepted and aggregated; each refusal says why
    assert results["honest"].accepted, results["honest"].reason
    expected = {
        "nan": "update has NaN or Inf values",
        "inf": "update has NaN or Inf values",
        "int8": "update is encoded with int8 but round 1 asks for bitdelta",
        "huge": "exceeds round 1's norm bound 1e+04",
    }
    for name, text in expected.items():
        assert not results[name].accepted and text in results[name].reason, results[name].reason
    db = sqlite3.connect(tiny_home / "ledger.db")
    rows = dict(
        db.execute(
            "SELECT c.name, s.decision || ': ' || s.reason FROM submissions s "
            "JOIN contributors c ON c.contributor_id = s.contributor_id WHERE s.round_number = 1"
        ).fetchall()
    )
    assert rows["honest"] == "accepted: accepted at intake"
    for name, text in expected.items():
        assert rows[name].startswith("rejected: ") and text in rows[name]
    summary = json.loads(summary_file.read_text().splitlines()[0])
    assert (summary["received"], summary["accepted"]) == (5, 1)


@pytest.mark.slow
def test_under_clip_norm_honest_noised_updates_pass_and_a_scaling_attacker_is_refused(
    tmp_path: Path,
) -> None:
    # Prepare: real `gym-client join` processes; the task clips to 0.5 and adds update noise,
    # the clients carry BitDelta error feedback from round to round
    fed = Federation(
        tmp_path / "fed",
        clients=2,
        rounds=3,
        steps=10,
        examples_per_client=40,
        aggregator="median",
        byzantine="scaling",
        byzantine_clients=1,
    )
    fed.prepare()
    config = fed.coordinator_home / "coordinator.toml"
    config.write_text(config.read_text() + "clip_norm = 0.5\nupdate_noise_multiplier = 0.05\n")

    # Execute
    with fed:
        fed.start()
        fed.wait(timeout_s=420)

    # Assert: every honest update of every round was accepted; every boosted one refused at intake
    rows = fed.summaries()
    assert [(r["received"], r["accepted"]) for r in rows] == [(3, 2)] * 3
    db = sqlite3.connect(fed.coordinator_home / "ledger.db")
    decisions = db.execute(
        "SELECT c.name, s.decision, s.reason FROM submissions s "
        "JOIN contributors c ON c.contributor_id = s.contributor_id"
    ).fetchall()
    attacker = [(d, r) for name, d, r in decisions if name == "byzantine-0"]
    assert len(attacker) == 3
    assert all(d == "rejected" and "norm bound" in r for d, r in attacker), attacker
    assert all(d == "accepted" for name, d, _ in decisions if name != "byzantine-0")
