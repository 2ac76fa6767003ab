"""A whole sweep repeats from its seed: data, attackers, training, each round's draw of
contributors by reputation, the rewards that move reputation, and the outcome."""

from __future__ import annotations

from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import pytest
from netns import isolated
from sqlmodel import Session

from zoo_gym import ledger
from zoo_gym.coordinator.config import load_config
from zoo_gym.simulation.experiment import run_sweep
from zoo_gym.simulation.sweep import CellResult, SweepConfig, SweepError, load_sweep


def sweep(seed: int, engine: str = "batched", **extra: Any) -> SweepConfig:
    """6 contributors, 4 drawn per round by reputation (floor 0.2), rewards scored first-order
    so reputations move between rounds; one of them flips its update's sign."""
    return SweepConfig.model_validate(
        {
            "aggregators": ["fedavg", "median"],
            "attacks": ["sign_flip"],
            "byzantine_shares": [0.2],
            "clients": 6,
            "rounds": 3,
            "steps": 3,
            "examples_per_client": 12,
            "warmup_rounds": 1,
            "engine": engine,
            "seed": seed,
            **extra,
            "coordinator": {
                "clients_per_round": 4,
                "rewards": {"method": "first_order", "selection_floor": 0.2},
            },
        }
    )


def ledger_of(workdir: Path, result: CellResult) -> dict[str, Any]:
    """Who each round drew, what was decided and paid, and the reputations at the end."""
    cell = f"{result.aggregator}-{result.attack}-{round(result.byzantine_share * 100):02d}"
    home = workdir / "cells" / cell
    engine = ledger.open_database(load_config(home / "coordinator.toml").ledger_url)
    with Session(engine) as session:
        drawn = sorted(
            (s.round_number, s.contributor_id, s.decision, s.selected)
            for s in ledger.list_submissions(session)
        )
        rewards = sorted(
            (r.round_number, r.contributor_id, str(r.amount), r.reputation_after)
            for r in ledger.list_rewards(session)
        )
        reputations = sorted(
            (c.contributor_id, c.reputation) for c in ledger.list_contributors(session)
        )
    engine.dispose()
    return {"drawn": drawn, "rewards": rewards, "reputations": reputations}


def outcome(workdir: Path, results: list[CellResult]) -> list[dict[str, Any]]:
    return [{**asdict(replace(r, seconds=0.0)), **ledger_of(workdir, r)} for r in results]


@pytest.mark.parametrize("engine", ["batched", "inprocess"])
def test_a_sweep_repeats_from_its_seed_reputation_draws_included(
    tmp_path: Path, engine: str
) -> None:
    # Execute: the same sweep twice in fresh directories, and once with another seed
    first = outcome(tmp_path / "a", run_sweep(sweep(7, engine), tmp_path / "a"))
    again = outcome(tmp_path / "b", run_sweep(sweep(7, engine), tmp_path / "b"))
    other = outcome(tmp_path / "c", run_sweep(sweep(8, engine), tmp_path / "c"))

    # Assert: every number and every ledger row repeats, bit for bit
    assert first == again
    # the draws were real: 4 of 6 each round, reputations moved and were paid from
    for cell in first:
        rounds = {r for r, *_ in cell["drawn"]}
        assert rounds == {1, 2, 3, 4}  # the warm-up's round, then the cell's
        assert all(sum(1 for r, *_ in cell["drawn"] if r == n) == 4 for n in rounds)
        assert len({c for _, c, *_ in cell["drawn"]}) > 4  # different rounds, different draws
        assert any(rep != 0.0 for _, rep in cell["reputations"])
    # another seed: other data and other draws
    assert [c["drawn"] for c in first] != [c["drawn"] for c in other]
    assert [c["losses"] for c in first] != [c["losses"] for c in other]


@pytest.mark.timeout(450)
def test_a_sweep_on_flowers_simulation_engine_repeats_from_its_seed(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    pytest.importorskip("ray", reason="Flower's simulation engine needs the `sim` extra (ray)")
    if not isolated(request, timeout=420):  # Ray listens on every interface: there, only lo
        return
    # Execute: the sweep on Ray, its two cells at once, each cell's actors free to take
    # contributors in any order; and the same sweep on the in-process engine
    first = outcome(tmp_path / "a", run_sweep(sweep(7, "ray", jobs=2), tmp_path / "a"))
    again = outcome(tmp_path / "b", run_sweep(sweep(7, "inprocess"), tmp_path / "b"))

    # Assert: every number and every ledger row is the in-process engine's, which repeats
    # from its seed (above), and the draws were real
    assert first == again
    for cell in first:
        assert all(sum(1 for r, *_ in cell["drawn"] if r == n) == 4 for n in (1, 2, 3, 4))
        assert len({c for _, c, *_ in cell["drawn"]}) > 4
        assert any(rep != 0.0 for _, rep in cell["reputations"])


def test_coordinator_settings_the_sweep_sets_itself_are_refused_in_one_line() -> None:
    with pytest.raises(SweepError, match=r"coordinator\.rounds is the sweep's to set; use rounds"):
        load_sweep(None, {"coordinator": {"rounds": 3}})
    with pytest.raises(SweepError, match=r"coordinator\.training\.steps is the sweep's to set"):
        load_sweep(None, {"coordinator": {"training": {"steps": 3}}})
    with pytest.raises(
        SweepError, match=r"coordinator\.rewards\.selection_floor: Input should be less than"
    ):
        load_sweep(None, {"coordinator": {"rewards": {"selection_floor": 2}}})
    with pytest.raises(SweepError, match=r"coordinator\.shards: Extra inputs are not permitted"):
        load_sweep(None, {"coordinator": {"shards": 3}})
