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
    # the demo's rewards, closeness + exact_answer, are each within [0, 1] per completion
    assert 0.0 <= before <= 2.0 and 0.0 <= after <= 2.0
    db = sqlite3.connect(fed.coordinator_home / "ledger.db")
    decisions = db.execute("SELECT decision FROM submissions WHERE round_number = 1").fetchall()
    assert sorted(d for (d,) in decisions) == ["accepted", "accepted"]
    client_log = (fed.workdir / "client-0.log").read_text()
    assert "Traceback" not in client_log


@pytest.mark.slow
def test_grpo_raises_the_task_reward_of_an_sft_warmed_base(tmp_path: Path) -> None:
    # Prepare: the demo's federation: 3 contributors, 3 SFT rounds, then the operator's switch
    # to GRPO (closeness + exact_answer) for 5 rounds
    fed = Federation(
        tmp_path / "fed", clients=3, rounds=8, steps=30, method="grpo", warmup_rounds=3
    )

    # Execute
    rows = run(fed, timeout_s=1200)
    ends_on = [str(r["published_version"] or r["base_version"]) for r in rows]
    scores = fed.task_scores(ends_on)

    # Assert: the switch applied from round 4 exactly (the coordinator scores by reward only then)
    history = [(r["round"], r["reward_before"], r["mean_reward"], r["status"]) for r in rows]
    assert [r["reward_before"] is not None for r in rows] == [False] * 3 + [True] * 5, history
    # ... and the GRPO rounds end on a model earning more reward than the SFT-warmed base
    last = rows[-1]
    start = rows[3]["reward_before"]
    end = last["mean_reward"] if last["status"] == "published" else last["reward_before"]
    assert isinstance(start, float) and isinstance(end, float)
    assert end > start + 0.02, history
    # the same on the closeness alone, scored again from the published weights
    warmed, final = scores[ends_on[2]], scores[ends_on[-1]]
    assert final[0] > warmed[0], (warmed, final, history)
