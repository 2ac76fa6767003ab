"""Our Krum, Multi-Krum, median and trimmed mean against Flower's own implementations.

On well-conditioned inputs (deltas of unit scale) the numbers must agree. Flower's trimmed
mean cuts int(beta * n) from each side, so beta = (f + 0.5) / n trims exactly f.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, MetricRecord, RecordDict
from flwr.serverapp.strategy.fedtrimmedavg import trim_mean
from flwr.serverapp.strategy.multikrum import compute_distances, select_multikrum
from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

from zoo_gym.aggregation import krum, median, trimmed_mean


def records(x: torch.Tensor) -> list[RecordDict]:
    return [
        RecordDict(
            {
                "arrays": ArrayRecord({"w": Array(row.numpy().copy())}),
                "metrics": MetricRecord({"num-examples": 1}),
            }
        )
        for row in x
    ]


def updates(seed: int, n: int, d: int = 64) -> torch.Tensor:
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(("n", "f", "m"), [(7, 2, 1), (10, 3, 1), (10, 2, 4), (20, 4, 12)])
def test_krum_matches_flower(n: int, f: int, m: int) -> None:
    x = updates(n + f + m, n)
    contents = records(x)
    chosen = select_multikrum(contents, num_malicious_nodes=f, num_nodes_to_select=m)
    flower_idx = sorted(next(i for i, c in enumerate(contents) if c is s) for s in chosen)
    flower_vec = aggregate_arrayrecords(chosen, "num-examples")["w"].numpy()
    ours = krum(x, f=f, m=m)
    assert [i for i, d in enumerate(ours.decisions) if d.selected] == flower_idx
    np.testing.assert_allclose(ours.vector.numpy(), flower_vec, rtol=1e-5, atol=1e-6)


def test_squared_distances_match_flower() -> None:
    from zoo_gym.aggregation._core import squared_distances

    x = updates(0, 9)
    ours = squared_distances(x).numpy()
    theirs = compute_distances([ArrayRecord({"w": Array(r.numpy().copy())}) for r in x])
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("n", [5, 6, 11, 20])
def test_median_matches_flower(n: int) -> None:
    x = updates(n, n)
    np.testing.assert_allclose(
        median(x).vector.numpy(), np.median(x.numpy(), axis=0), rtol=1e-6, atol=1e-7
    )


@pytest.mark.parametrize(("n", "f"), [(5, 1), (10, 2), (20, 6), (21, 9)])
def test_trimmed_mean_matches_flower(n: int, f: int) -> None:
    x = updates(n * f, n)
    theirs = trim_mean(x.numpy(), (f + 0.5) / n)
    np.testing.assert_allclose(trimmed_mean(x, f=f).vector.numpy(), theirs, rtol=1e-5, atol=1e-6)
