"""The ServerApp and ClientApps of deployment, run in-process on the loopback Grid."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlmodel import Session

from zoo_gym import ledger
from zoo_gym.core.synthetic import make_examples, shard
from zoo_gym.simulation.inprocess import InProcessFederation


@pytest.mark.parametrize("aggregator", ["fedavg", "trimmed_mean"])
def test_loopback_federation_improves_and_records(tiny_home: Path, aggregator: str) -> None:
    # Prepare
    shards = shard(make_examples(3 * 60, seed=1), 3)
    overrides = {"rounds": 2, "min_clients": 3, "aggregator": aggregator, "byzantine_f": 1}
    fed = InProcessFederation.build(tiny_home, shards, overrides=overrides)

    # Execute
    summaries = fed.run()

    # Assert
    assert [s.status for s in summaries] == ["published", "published"]
    assert [s.accepted for s in summaries] == [3, 3]
    assert summaries[-1].loss_after < summaries[0].loss_before
    assert summaries[1].base_version == summaries[0].published_version == "v0001"
    with Session(fed.coordinator.engine) as session:
        subs = ledger.list_submissions(session)
        assert len(subs) == 6
        assert all(s.decision == "accepted" for s in subs)
        assert {s.round_number for s in subs} == {1, 2}
        versions = [v.version for v in ledger.list_model_versions(session)]
        assert versions[-2:] == ["v0001", "v0002"]
    assert all(r.base_version == "v0001" for r in fed.runtimes.values())
