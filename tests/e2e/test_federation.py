"""A whole federation as real processes on 127.0.0.1: coordinator + 3 clients, 2 rounds."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from zoo_gym.simulation.demo import Federation

pytestmark = pytest.mark.e2e


def test_three_clients_two_rounds(tmp_path: Path) -> None:
    # Prepare
    fed = Federation(tmp_path / "fed", clients=3, rounds=2, steps=20, examples_per_client=60)

    # Execute
    with fed:
        fed.prepare()
        fed.start()
        fed.wait(timeout_s=420)
        fed.wait_clients(60)
        codes = {name: proc.returncode for name, proc in fed.processes.items()}

    # Assert: the round loop finished cleanly and the model improved
    assert codes["coordinator"] == 0, (tmp_path / "fed" / "coordinator.log").read_text()[-3000:]
    rows = fed.summaries()
    assert [r["status"] for r in rows] == ["published", "published"]
    assert rows[-1]["loss_after"] < rows[0]["loss_before"]
    assert [r["published_version"] for r in rows] == ["v0001", "v0002"]

    # one ledger row per submission, with its decision
    db = sqlite3.connect(fed.coordinator_home / "ledger.db")
    subs = db.execute(
        "SELECT round_number, contributor_id, decision, base_version FROM submissions"
    ).fetchall()
    assert len(subs) == 6
    assert {d for _, _, d, _ in subs} == {"accepted"}
    assert sorted({r for r, *_ in subs}) == [1, 2]

    # clients trained round r+1 on the version published in round r
    assert {b for r, _, _, b in subs if r == 1} == {"v0000"}
    assert {b for r, _, _, b in subs if r == 2} == {"v0001"}
    for i in range(3):
        state = json.loads((fed.client_home(i) / "state" / "state.json").read_text())
        assert [
            c["base_version"]
            for c in sorted(state["contributions"].values(), key=lambda c: c["round"])
        ] == ["v0000", "v0001"]
        assert (fed.client_home(i) / "state" / "models" / "v0001" / "model.safetensors").exists()
