"""Reputation-weighted selection of the contributors a round samples."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import pytest
from sqlmodel import Session

from zoo_gym import ledger
from zoo_gym.coordinator.config import CoordinatorConfig, load_config
from zoo_gym.coordinator.service import Coordinator
from zoo_gym.core.identity import Identity
from zoo_gym.core.protocol import register_statement


def _coordinator(
    home: Path, floor: float, seed: int | None = None
) -> tuple[Coordinator, list[int]]:
    config = load_config(home / "coordinator.toml")
    settings = {"clients_per_round": 1, "rewards": {"selection_floor": floor}}
    co = Coordinator(
        CoordinatorConfig.model_validate(
            {**config.model_dump(), **settings, "selection_seed": seed}
        )
    )
    nodes = []
    for name, reputation in (("good", 0.8), ("fair", 0.2), ("new", 0.0)):
        identity, ts = Identity.generate(), int(time.time() * 1000)
        reg = co.backend.register(
            public_key=identity.public_key,
            name=name,
            timestamp_ms=ts,
            signature=identity.sign(register_statement(identity.public_key, name, ts)),
        )
        with Session(co.engine) as session:  # as earlier rounds would have left it
            row = ledger.get_contributor(session, contributor_id=identity.contributor_id)
            assert row is not None
            row.reputation = reputation
            session.add(row)
            session.commit()
        nodes.append(reg.node_id)
    return co, nodes


def test_sampling_follows_reputation_with_a_floor_for_newcomers(tiny_home: Path) -> None:
    # Prepare: weights max(r, 0.1) / 1.1 = 0.727, 0.182, 0.091
    co, nodes = _coordinator(tiny_home, floor=0.1)
    strategy = co.make_strategy(lambda: ())

    # Execute
    picks = Counter(strategy.sample(nodes, 1, r)[0] for r in range(2000))

    # Assert
    shares = [picks[n] / 2000 for n in nodes]
    for share, expected in zip(shares, (0.8 / 1.1, 0.2 / 1.1, 0.1 / 1.1), strict=True):
        assert abs(share - expected) < 0.05
    assert sorted(strategy.sample(nodes, 3, 1)) == sorted(nodes)


def test_floor_zero_samples_uniformly(tiny_home: Path) -> None:
    co, nodes = _coordinator(tiny_home, floor=0.0)
    strategy = co.make_strategy(lambda: ())
    picks = Counter(strategy.sample(nodes, 1, r)[0] for r in range(1500))
    assert all(abs(picks[n] / 1500 - 1 / 3) < 0.06 for n in nodes)


@pytest.mark.parametrize("floor", [0.0, 0.1])
def test_a_run_repeats_its_draws_from_its_seed(tiny_home: Path, floor: float) -> None:
    co, nodes = _coordinator(tiny_home, floor=floor, seed=7)
    again = co.make_strategy(lambda: ())
    strategy = co.make_strategy(lambda: ())
    shuffled = list(reversed(nodes))  # the grid's order of node ids does not matter
    draws = [strategy.sample(nodes, 2, r) for r in range(1, 41)]
    assert draws == [again.sample(shuffled, 2, r) for r in range(1, 41)]
    assert len({tuple(d) for d in draws}) > 1  # the rounds draw differently
    other = co.make_strategy(lambda: ())
    other.seed = 8
    assert draws != [other.sample(nodes, 2, r) for r in range(1, 41)]


def test_without_a_seed_the_draws_cannot_be_foretold(tiny_home: Path) -> None:
    co, nodes = _coordinator(tiny_home, floor=0.0)  # the default: no selection_seed
    strategy = co.make_strategy(lambda: ())
    assert strategy.seed is None
    draws = [tuple(strategy.sample(nodes, 2, 1)) for _ in range(40)]  # the same round
    assert len(set(draws)) > 1
