"""Krum scores computed a few rows at a time equal the scores of the whole matrix."""

from __future__ import annotations

import pytest
import torch

from zoo_gym.aggregation import krum
from zoo_gym.aggregation.krum import krum_scores


def whole_matrix_scores(dist: torch.Tensor, f: int) -> torch.Tensor:
    n = dist.shape[0]
    off = dist.clone()
    off.fill_diagonal_(float("inf"))
    return torch.topk(off, n - f - 2, dim=1, largest=False).values.sum(dim=1)


@pytest.mark.parametrize(("n", "f"), [(5, 1), (64, 6), (65, 6), (150, 20)])
def test_scores_by_row_blocks_equal_the_whole_matrix(n: int, f: int) -> None:
    x = torch.randn(n, 40, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
    dist = torch.cdist(x, x).square()
    assert torch.equal(krum_scores(dist, f), whole_matrix_scores(dist, f))


def test_multikrum_leaves_out_a_far_group_across_score_blocks() -> None:
    g = torch.Generator().manual_seed(9)
    honest = torch.randn(130, 300, generator=g)
    far = 50.0 + torch.randn(20, 300, generator=g)
    x = torch.cat([far[:10], honest, far[10:]])  # far updates on both ends of the order
    result = krum(x, f=20, m=130)
    assert [d.selected for d in result.decisions] == [False] * 10 + [True] * 130 + [False] * 10
    assert torch.allclose(result.vector, honest.mean(dim=0), atol=1e-5)
