"""A contributor killed mid-round restarts, is handed the open round again and submits once."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sqlite3
import time
from pathlib import Path

import pytest
import torch
from flwr.app import RecordDict
from sqlmodel import Session

from zoo_gym import ledger
from zoo_gym.client.session import already_accepted
from zoo_gym.compression import CodecSpec, encode
from zoo_gym.coordinator.intake import OpenRound
from zoo_gym.core.delta import TensorSpec
from zoo_gym.core.protocol import SignedSubmission
from zoo_gym.simulation.demo import Federation
from zoo_gym.simulation.inprocess import InProcessFederation


def wait_for(path: Path, text: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text(errors="replace"):
            return
        time.sleep(0.2)
    raise TimeoutError(f"{text!r} did not appear in {path} within {timeout_s:.0f} s")


@pytest.mark.e2e
@pytest.mark.slow  # about 75 s: three processes, a 400-step round
def test_client_killed_mid_training_resumes_the_round_and_submits_once(tmp_path: Path) -> None:
    # Prepare: two clients, one round long enough to be killed in
    fed = Federation(tmp_path / "fed", clients=2, rounds=1, steps=400, examples_per_client=40)

    with fed:
        fed.prepare()
        fed.start()
        log = tmp_path / "fed" / "client-0.log"
        wait_for(log, "round 1: training on", timeout_s=180)
        first = fed.processes["client-0"]

        # Execute: SIGKILL the training client (its own process group, by PID), then restart it
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(timeout=30)
        killed_log = log.read_text(errors="replace")
        fed.start_client(0)
        fed.wait(timeout_s=300)
        fed.wait_clients(60)

    # Assert: the round completed with exactly one accepted submission per contributor
    assert first.returncode == -signal.SIGKILL
    assert "uploaded" not in killed_log  # it died before submitting
    rows = fed.summaries()
    assert [(r["round"], r["status"], r["accepted"]) for r in rows] == [(1, "published", 2)]
    db = sqlite3.connect(fed.coordinator_home / "ledger.db")
    subs = db.execute(
        "SELECT contributor_id, decision FROM submissions WHERE round_number = 1"
    ).fetchall()
    db.close()
    assert sorted(d for _, d in subs) == ["accepted", "accepted"]
    assert len({c for c, _ in subs}) == 2
    state = json.loads((fed.client_home(0) / "state" / "state.json").read_text())
    assert [(c["round"], c["decision"]) for c in state["contributions"].values()] == [
        (1, "accepted")
    ]
    assert log.read_text(errors="replace").count("round 1: uploaded") == 1


def test_a_second_upload_for_a_round_is_refused_and_the_client_counts_it_done(
    tiny_home: Path,
) -> None:
    # Prepare: an open round and one contributor (a crash lost its local record of the first upload)
    fed = InProcessFederation.build(tiny_home, [[]], overrides={"min_clients": 1})
    backend = fed.coordinator.backend
    identity = next(iter(fed.runtimes.values())).identity
    node = next(iter(fed.runtimes))
    layout = (TensorSpec("m.lora_B", (4, 2)),)
    with Session(fed.coordinator.engine) as session:
        ledger.open_round(
            session, number=1, base_version="v0000", seed=1, aggregator="fedavg", codec="none"
        )
    backend.open_round = OpenRound(1, "v0000", layout, 0)
    payload = encode({"m.lora_B": torch.ones(4, 2)}, CodecSpec(codec="none"))
    spool = tiny_home / "upload.zgde"
    spool.write_bytes(payload)

    def upload() -> tuple[bool, str]:
        fields = dict(
            contributor_id=identity.contributor_id,
            round=1,
            base_version="v0000",
            message_id="m1",
            nonce=os.urandom(16),
            payload_sha256=hashlib.sha256(payload).hexdigest(),
            payload_size=len(payload),
        )
        unsigned = SignedSubmission(**fields)  # type: ignore[arg-type]
        signed = SignedSubmission(**fields, signature=identity.sign(unsigned.statement()))  # type: ignore[arg-type]
        verdict, _ = backend.receive(signed, spool, RecordDict(), node_id=node)
        return verdict.accepted, verdict.reason

    # Execute
    first, second = upload(), upload()

    # Assert
    assert first == (True, "accepted at intake")
    assert second[0] is False and already_accepted(second[1]), second
    with Session(fed.coordinator.engine) as session:
        accepted = [
            s for s in ledger.list_submissions(session, round_number=1) if s.decision == "accepted"
        ]
    assert len(accepted) == 1
    assert not already_accepted("round 1 is not open for submissions; wait for the next task")
