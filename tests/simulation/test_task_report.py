"""What an attack-matrix table says about its task, its split and rules that made no progress."""

from __future__ import annotations

import doctest

from zoo_gym.simulation import report
from zoo_gym.simulation.sweep import CellResult, SweepConfig


def _cell(rule: str, attack: str, share: float, losses: tuple[float, ...]) -> CellResult:
    return CellResult(
        aggregator=rule,
        attack=attack,
        byzantine_share=share,
        byzantine_clients=round(share * 10),
        f=3,
        losses=losses,
        published=len(losses) - 1,
        byzantine_selected=0.5 if attack != "none" else 0.0,
        seconds=1.0,
    )


def test_report_names_the_task_and_its_split() -> None:
    assert doctest.testmod(report).failed == 0
    header = {
        kw["partition"]: report.markdown([], SweepConfig(task="arithmetic", **kw)).splitlines()[0]
        for kw in (
            {"partition": "labels", "classes_per_client": 1},
            {"partition": "dirichlet", "alpha": 0.3},
            {"partition": "iid"},
        )
    }

    assert "(arithmetic task, 1 class per client, 10 clients," in header["labels"]
    assert "(arithmetic task, Dirichlet alpha = 0.3 split, 10 clients," in header["dirichlet"]
    assert "(arithmetic task, IID split, 10 clients," in header["iid"]


def test_cells_of_a_rule_without_progress_give_their_own_quality() -> None:
    results = [
        _cell("fedavg", "none", 0.0, (3.0, 2.0)),  # q = 1.0
        _cell("fedavg", "alie", 0.2, (3.0, 2.75)),  # q = 0.25: 25% of the baseline
        _cell("median", "none", 0.0, (3.0, 3.5)),  # q = -0.5: no scale for the cells
        _cell("median", "alie", 0.2, (3.0, 2.9)),  # q = +0.1
    ]

    table = report.markdown(results, SweepConfig(aggregators=["fedavg", "median"]))

    assert "| fedavg | alie | 25% (50%) |" in table
    assert "| median | none | loss 3.000 -> 3.500 |" in table
    assert "| median | alie | q +0.100 (50%) |" in table
