"""Bulyan's recursive Krum against its definition: re-score the remainder with Krum, pick the
lowest (ties as `krum.lowest`), repeat."""

from __future__ import annotations

import pytest
import torch

from zoo_gym.aggregation._core import squared_distances
from zoo_gym.aggregation.bulyan import recursive_krum
from zoo_gym.aggregation.krum import krum_scores, lowest


def by_definition(dist: torch.Tensor, f: int, theta: int) -> list[int]:
    remaining = list(range(dist.shape[0]))
    chosen: list[int] = []
    while len(chosen) < theta:
        idx = torch.tensor(remaining)
        sub = dist[idx][:, idx]
        best = remaining[lowest(krum_scores(sub, f), 1, sub)[0]]
        chosen.append(best)
        remaining.remove(best)
    return chosen


def points(kind: str, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "gaussian":
        return torch.randn(n, 16, generator=g)
    if kind == "integers":  # many exact ties between distances and between scores
        return torch.randint(-2, 3, (n, 3), generator=g).float()
    if kind == "duplicates":  # whole groups of equal updates: zero distances
        return torch.randint(0, 3, (n, 1), generator=g).float().repeat(1, 4)
    x = torch.randn(n, 16, generator=g)  # attackers far away and at wildly different scales
    x[: n // 5] *= torch.logspace(3, 18, n // 5)[:, None]
    return x


@pytest.mark.parametrize("kind", ["gaussian", "integers", "duplicates", "outliers"])
@pytest.mark.parametrize(("n", "f"), [(7, 1), (11, 2), (23, 5), (40, 9), (60, 0), (64, 15)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_picks_equal_rescoring_the_remainder(kind: str, n: int, f: int, seed: int) -> None:
    dist = squared_distances(points(kind, n, seed))
    theta = n - 2 * f
    assert recursive_krum(dist, f, theta) == by_definition(dist, f, theta)


def test_the_hand_computed_case() -> None:
    # points 0, 1, 2, 3, 4, 100, 200 with f = 1 (see test_rules: Bulyan's hand-computed case)
    dist = squared_distances(torch.tensor([0.0, 1, 2, 3, 4, 100, 200])[:, None])
    assert recursive_krum(dist, 1, 5) == [2, 3, 1, 4, 5]  # 100: a three-way tie at 100^2


def test_a_thousand_updates_are_chosen_without_rescoring_each_time() -> None:
    x = torch.randn(1000, 8, generator=torch.Generator().manual_seed(3))
    dist = squared_distances(x)
    chosen = recursive_krum(dist, 100, 800)
    assert len(set(chosen)) == 800
    # the first picks of the definition (each re-scores the whole remainder)
    assert chosen[:3] == by_definition(dist, 100, 3)


def test_two_hundred_updates_with_attackers_equal_the_definition() -> None:
    dist = squared_distances(points("outliers", 200, 4))
    assert recursive_krum(dist, 20, 160) == by_definition(dist, 20, 160)
