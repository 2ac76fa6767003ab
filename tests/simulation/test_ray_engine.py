"""The same sweep cell on Flower's simulation engine (Ray): same ServerApp, same ClientApp."""

from __future__ import annotations

from pathlib import Path

import pytest
from netns import isolated

from zoo_gym.simulation.experiment import make_template, run_cell
from zoo_gym.simulation.sweep import Cell, SweepConfig

pytest.importorskip("ray", reason="Flower's simulation engine needs the `sim` extra (ray)")


@pytest.mark.timeout(450)
def test_ray_engine_runs_the_round_loop_with_a_data_attacker_and_a_crafted_one(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if not isolated(request, timeout=420):  # Ray listens on every interface: there, only lo
        return
    # Prepare: 5 clients; under label_flip attacker 1 is a Ray node, under sign_flip it is crafted
    config = SweepConfig(
        aggregators=["median"],
        attacks=["label_flip", "sign_flip"],
        byzantine_shares=[0.2],
        clients=5,
        rounds=1,
        steps=3,
        examples_per_client=20,
        engine="ray",
        jobs=2,
        warmup_rounds=0,
    )
    template = make_template(tmp_path, config)

    # Execute
    poisoned = run_cell(config, Cell("median", "label_flip", 0.2), template, tmp_path)
    crafted = run_cell(config, Cell("median", "sign_flip", 0.2), template, tmp_path)

    # Assert: both rounds ran through intake and aggregation, and the model improved
    for result in (poisoned, crafted):
        assert result.published == 1 and result.byzantine_clients == 1
        assert result.losses[1] < result.losses[0]
    # the ledger holds five submissions per round, every one accepted at intake
    from sqlmodel import Session

    from zoo_gym import ledger
    from zoo_gym.coordinator.config import load_config

    for name in ("median-label_flip-20", "median-sign_flip-20"):
        home = tmp_path / "cells" / name
        engine = ledger.open_database(load_config(home / "coordinator.toml").ledger_url)
        with Session(engine) as session:
            subs = ledger.list_submissions(session)
        engine.dispose()
        assert len(subs) == 5 and {s.decision for s in subs} == {"accepted"}
