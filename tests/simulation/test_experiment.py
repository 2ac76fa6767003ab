"""`gym-sim run`'s engine: a small attack matrix on the tiny task, its tables and plots."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest

from zoo_gym.simulation.experiment import run_sweep
from zoo_gym.simulation.report import write_report
from zoo_gym.simulation.sweep import SweepConfig, SweepError, byzantine_indices, load_sweep


def test_scaling_attack_breaks_fedavg_but_not_median(tmp_path: Path) -> None:
    # Prepare: 5 clients, one of them Byzantine, boosting the negated honest mean 20 times
    config = SweepConfig(
        aggregators=["fedavg", "median"],
        attacks=["scaling"],
        byzantine_shares=[0.2],
        clients=5,
        rounds=2,
        steps=6,
        examples_per_client=24,
        warmup_rounds=1,
        attack_params={"scaling": {"boost": 20.0}},
    )

    # Execute
    results = run_sweep(config, tmp_path / "work")
    paths = write_report(results, config, tmp_path / "out")

    # Assert: the baselines learn; FedAvg under model replacement ends worse than it started,
    # median still improves (the full-size matrix in the README measures how much)
    by = {(r.aggregator, r.attack): r for r in results}
    assert [(r.aggregator, r.attack, r.byzantine_clients) for r in results] == [
        ("fedavg", "none", 0),
        ("fedavg", "scaling", 1),
        ("median", "none", 0),
        ("median", "scaling", 1),
    ]
    assert by["fedavg", "none"].quality > 0.1 and by["median", "none"].quality > 0.1
    assert by["fedavg", "scaling"].quality < 0 < by["median", "scaling"].quality
    assert by["fedavg", "scaling"].byzantine_selected == 1.0
    # the median never took the boosted update in the cell's rounds (the warm-up's FedAvg
    # round, which selected everyone, does not count)
    assert by["median", "scaling"].byzantine_selected == 0.0
    assert all(len(r.losses) == 3 and r.f == 1 for r in results)

    # the report: CSV rows, a Markdown table, one PNG per share
    assert [p.name for p in paths] == ["results.csv", "results.md", "loss_byzantine_20.png"]
    with paths[0].open() as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 4 and float(rows[0]["relative_quality"]) == pytest.approx(1.0)
    assert float(rows[1]["relative_quality"]) == pytest.approx(
        by["fedavg", "scaling"].quality / by["fedavg", "none"].quality
    )
    assert math.isclose(float(rows[3]["quality"]), by["median", "scaling"].quality, rel_tol=1e-9)
    table = paths[1].read_text()
    assert "| median | scaling |" in table and "| fedavg | none | loss" in table
    assert paths[2].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and paths[2].stat().st_size > 10_000


def test_byzantine_clients_are_seeded_and_nested_across_shares() -> None:
    config = SweepConfig(clients=10, seed=4)
    small, large = byzantine_indices(config, 0.1), byzantine_indices(config, 0.3)
    assert len(small) == 1 and len(large) == 3 and set(small) <= set(large)
    assert byzantine_indices(SweepConfig(clients=10, seed=4), 0.3) == large
    assert config.tolerated == 3


def test_bad_sweeps_get_one_line(tmp_path: Path) -> None:
    with pytest.raises(
        SweepError, match="bulyan needs 15 clients to tolerate f = 3; raise clients to 15"
    ):
        load_sweep(None, {"aggregators": ["bulyan"]})
    with pytest.raises(SweepError, match="unknown attack 'krum'"):
        load_sweep(None, {"attacks": ["krum"]})
    bad = tmp_path / "sweep.toml"
    bad.write_text("clients = 'many'\n")
    with pytest.raises(SweepError, match=r"sweep.toml: clients: Input should be a valid integer"):
        load_sweep(bad, {})
