"""A Byzantine contributor among real processes: Multi-Krum leaves it out, the ledger says why,
and its own verified reward report shows that it earned nothing and why."""

from __future__ import annotations

import json
import sqlite3
from decimal import Decimal
from pathlib import Path

import pytest

from zoo_gym.simulation.demo import Federation

pytestmark = pytest.mark.e2e


def test_multikrum_leaves_out_a_scaling_attacker(tmp_path: Path) -> None:
    # Prepare: 4 honest clients and one started with `gym-client join --byzantine scaling`
    fed = Federation(
        tmp_path / "fed",
        clients=4,
        rounds=2,
        steps=10,
        examples_per_client=40,
        aggregator="multikrum",
        byzantine="scaling",
        byzantine_clients=1,
        stay=True,
    )

    # Execute
    with fed:
        fed.prepare()
        fed.start()
        fed.wait(timeout_s=420)
        fed.wait_clients(60)
        reports = [
            fed.reward_report(i, "--verify", "--format", "json") for i in range(fed.total_clients)
        ]

    # Assert: every round published and improved on the honest updates alone
    rows = fed.summaries()
    assert [(r["status"], r["accepted"], r["aggregated"]) for r in rows] == [
        ("published", 5, 4)
    ] * 2
    assert rows[-1]["loss_after"] < rows[0]["loss_before"]
    db = sqlite3.connect(fed.coordinator_home / "ledger.db")
    decisions = db.execute(
        "SELECT c.name, s.selected, s.aggregation_reason FROM submissions s "
        "JOIN contributors c ON c.contributor_id = s.contributor_id ORDER BY s.round_number"
    ).fetchall()
    attacker = [(selected, reason) for name, selected, reason in decisions if name == "byzantine-0"]
    assert len(attacker) == 2 and all(
        not selected and "not among the 4 lowest Krum scores" in reason
        for selected, reason in attacker
    )
    assert all(selected for name, selected, _ in decisions if name != "byzantine-0")

    # each contributor's report verifies against the signed checkpoint; the attacker earned nothing
    assert all(r.returncode == 0 for r in reports), [r.stderr for r in reports]
    statements = [json.loads(r.stdout) for r in reports]
    attacker_report, honest = statements[-1], statements[:-1]
    assert Decimal(attacker_report["totals"]["amount"]) == 0
    assert all("not used by multikrum" in row["reward_reason"] for row in attacker_report["rounds"])
    paid = sum(Decimal(s["totals"]["amount"]) for s in honest)
    assert paid == Decimal(200)  # two rounds, a pool of 100 each, split exactly among the honest
    assert all(row["verified"] for s in statements for row in s["rounds"])
