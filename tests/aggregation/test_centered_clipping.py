"""Centered clipping on the pairwise distances (two passes) against its steps as passes over
the updates (one per step), and how often it reads its source."""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch

from zoo_gym.aggregation import centered_clipping
from zoo_gym.aggregation.columns import Columns, TensorColumns

cc_module = importlib.import_module("zoo_gym.aggregation.centered_clipping")


class Reads:
    """A source that counts the values it hands out."""

    def __init__(self, inner: Columns) -> None:
        self.inner, self.values = inner, 0
        self.n, self.d, self.dtype = inner.n, inner.d, inner.dtype
        self.device, self.budget = inner.device, inner.budget

    def columns(self, start: int, stop: int, rows: Any = None) -> torch.Tensor:
        chunk = self.inner.columns(start, stop, rows)
        self.values += chunk.numel()
        return chunk


def updates(seed: int, n: int, d: int, spread: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g) + 2.0  # a common component
    x[: n // 4] = spread * torch.randn(n // 4, d, generator=g)  # attackers, far and at any scale
    return x


@pytest.mark.parametrize("spread", [1.0, 1e3, 1e8])
@pytest.mark.parametrize("tau", [None, 1.5, 40.0])
@pytest.mark.parametrize("center", [False, True])
def test_distances_give_the_steps_of_the_passes(
    monkeypatch: pytest.MonkeyPatch, spread: float, tau: float | None, center: bool
) -> None:
    x = updates(0, 21, 3001, spread)
    start = torch.full((3001,), 1.5) if center else None
    a = centered_clipping(x, tau=tau, iters=4, center=start)
    monkeypatch.setattr(cc_module, "GRAM_STEPS_LIMIT", 0)  # every count above it: passes
    b = centered_clipping(x, tau=tau, iters=4, center=start)
    assert torch.allclose(a.vector, b.vector, rtol=1e-5, atol=1e-6)
    for p, q in zip(a.decisions, b.decisions, strict=True):
        assert p.selected == q.selected
        assert p.weight == pytest.approx(q.weight, rel=1e-5)
        assert p.score == pytest.approx(q.score, rel=1e-5)


@pytest.mark.parametrize("far", [1e15, 1e30])  # 1e30: squared distances past float32 products
def test_a_far_attacker_moves_the_centre_by_at_most_the_radius_over_n(far: float) -> None:
    x = torch.zeros(5, 4)
    x[:4, 0] = torch.tensor([1.0, 2.0, 3.0, 4.0])
    x[4] = far
    result = centered_clipping(x, iters=1)  # radius: the median distance to 0, 3
    # scales 1, 1, 1, 3/4 and 3 / (2 far): the attacker adds 1.5 / 5 to every coordinate
    assert result.vector.tolist() == pytest.approx([(1 + 2 + 3 + 3 + 1.5) / 5, 0.3, 0.3, 0.3])
    assert result.decisions[4].score == pytest.approx(2 * far)


@pytest.mark.parametrize("iters", [1, 5, 20])
def test_two_passes_whatever_the_steps(iters: int) -> None:
    x = updates(1, 12, 5000, 10.0)
    source = Reads(TensorColumns(x, budget=12 * 500 * 4 * 8))
    centered_clipping(source, iters=iters)
    assert source.values == 2 * x.numel()
