"""GRPO through a whole federation on 127.0.0.1: the round completes and is scored by reward."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from zoo_gym.simulation.demo import Federation

pytestmark = pytest.mark.e2e


def run(fed: Federation, timeout_s: float) -> list[dict[str, object]]:
    with fed:
        fed.prepare()
        fed.start()
        fed.wait(timeout_s=timeout_s)
        fed.wait_clients(60)
        code = fed.processes["coordinator"].returncode
    assert code == 0, (fed.workdir / "coordinator.log").read_text()[-3000:]
    return fed.summaries()


def test_a_grpo_round_completes_with_the_reward_utility(tmp_path: Path) -> None:
    # Prepare: 2 contributors, 1 round of 4 GRPO steps
    fed = Federation(
        tmp_path / "fed", clients=2, rounds=1, steps=4, examples_per_client=32, method="grpo"
    )

    # Execute
    rows = run(fed, timeout_s=300)

    # Assert: both updates accepted, the round's utility is the mean validation reward
    (row,) = rows
    assert row["accepted"] == 2 and row["status"] in ("published", "rolled_back")
    before, after = row["reward_before"], row["mean_reward"]
    assert isinstance(before, float) and isinstance(after, float)
    # the demo's rewards, exact_answer + format, sum to 0, 1 or 2 per completion
    assert 0.0 <= before <= 2.0 and 0.0 <= after <= 2.0
    db = sqlite3.connect(fed.coordinator_home / "ledger.db")
    decisions = db.execute("SELECT decision FROM submissions WHERE round_number = 1").fetchall()
    assert sorted(d for (d,) in decisions) == ["accepted", "accepted"]
    client_log = (fed.workdir / "client-0.log").read_text()
    assert "Traceback" not in client_log


@pytest.mark.slow
def test_grpo_raises_the_mean_validation_reward_over_rounds(tmp_path: Path) -> None:
    # Prepare: the demo's GRPO federation, 3 contributors, 4 rounds
    fed = Federation(tmp_path / "fed", clients=3, rounds=4, steps=20, method="grpo")

    # Execute
    rows = run(fed, timeout_s=1200)

    # Assert: the published model earns more reward than the tiny base did
    published = [r for r in rows if r["status"] == "published"]
    assert published, rows
    first, last = rows[0]["reward_before"], published[-1]["mean_reward"]
    assert isinstance(first, float) and isinstance(last, float)
    assert last > first + 0.2, [(r["reward_before"], r["mean_reward"], r["status"]) for r in rows]
