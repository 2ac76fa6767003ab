"""A stop that lands while the round loop aggregates: the round is recorded aborted with the
coordinator's reason, nothing is paid or published, and the loop ends (in-process Grid)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sqlmodel import Session

from zoo_gym import ledger
from zoo_gym.coordinator.service import Coordinator
from zoo_gym.coordinator.strategy import ZooStrategy
from zoo_gym.core.synthetic import make_examples, shard
from zoo_gym.simulation.inprocess import InProcessFederation


def test_stop_while_aggregating_aborts_the_round(
    tiny_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: two rounds asked for; the stop comes while round 1 aggregates
    shards = shard(make_examples(2 * 16, seed=3), 2)
    overrides = {"rounds": 2, "min_clients": 2, "training": {"steps": 2}}
    fed = InProcessFederation.build(tiny_home, shards, overrides=overrides)
    co = fed.coordinator
    build = Coordinator.make_strategy

    def stopping_strategy(self: Coordinator, layout: Any) -> ZooStrategy:
        strategy = build(self, layout)
        aggregate = strategy.aggregate_round

        def aggregate_then_stop(server_round: int, replies: Any) -> Any:
            result = aggregate(server_round, replies)
            self.stop.set()  # what serve does on SIGTERM
            return result

        strategy.aggregate_round = aggregate_then_stop  # type: ignore[method-assign]
        return strategy

    monkeypatch.setattr(Coordinator, "make_strategy", stopping_strategy)

    # Execute
    summaries = fed.run()

    # Assert: one round, aborted with the reason and the true counts; no rewards, no new version
    assert [(s.round, s.status, s.accepted) for s in summaries] == [(1, "aborted", 2)]
    assert summaries[0].published_version == ""
    with Session(co.engine) as session:
        [row] = ledger.list_rounds(session)
        assert row.status == "aborted" and row.metrics["reason"] == "coordinator stopping"
        assert row.metrics["aborted_by"] == "coordinator"
        assert ledger.list_rewards(session) == []
        assert ledger.list_model_versions(session) == []
    assert co.registry.latest().version == "v0000"
