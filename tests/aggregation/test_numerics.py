"""Krum on updates that are small next to the weights.

With weights of magnitude 1e3 and deltas of 1e-3, ||x||^2 + ||y||^2 - 2 x.y in float32 on
the full weights (Flower's `compute_distances`) is dominated by rounding error and Krum
picks an attacker. Our distances come from chunked float32 products of updates shifted by
a central one, accumulated in float64, and pick the honest ones, given deltas or even full
weights. Below: those distances against a float64 reference on every code path.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from flwr.app import Array, ArrayRecord, MetricRecord, RecordDict
from flwr.serverapp.strategy.multikrum import select_multikrum

from zoo_gym.aggregation import RULES, aggregate, krum, median, trimmed_mean
from zoo_gym.aggregation._core import squared_distances
from zoo_gym.aggregation._select import coordinatewise, sorted_columns


def test_small_deltas_on_large_weights() -> None:
    g = torch.Generator().manual_seed(0)
    n_honest, f, d = 8, 3, 50_000
    weights = 1e3 * (1.0 + torch.rand(d, generator=g))  # (d,)
    direction = 1e-3 * torch.randn(d, generator=g)
    honest = direction + 1e-4 * torch.randn(n_honest, d, generator=g)  # a tight honest cluster
    attack = -5 * direction + 1e-4 * torch.randn(f, d, generator=g)  # far away, loosely spread
    deltas = torch.cat([attack, honest])  # attackers first: ties cannot favour them
    full = weights + deltas  # (n, d) float32 full weights

    contents = [
        RecordDict(
            {
                "arrays": ArrayRecord({"w": Array(row.numpy().copy())}),
                "metrics": MetricRecord({"num-examples": 1}),
            }
        )
        for row in full
    ]
    chosen = select_multikrum(contents, num_malicious_nodes=f, num_nodes_to_select=n_honest)
    flower_idx = {next(i for i, c in enumerate(contents) if c is s) for s in chosen}
    assert flower_idx & set(range(f)), "Flower's float32 distances are expected to pick attackers"

    for x in (deltas, full):
        result = krum(x, f=f, m=n_honest)
        assert [d.selected for d in result.decisions] == [False] * f + [True] * n_honest


def direct_distances(x: torch.Tensor) -> torch.Tensor:
    x64 = x.double()
    return torch.cdist(x64, x64).square()


@pytest.mark.parametrize(("n", "d"), [(5, 3), (20, 3_000), (45, 40_000), (300, 5_000)])
@pytest.mark.parametrize("threads", [1, 2])
def test_chunked_shifted_gram_matches_float64(
    n: int, d: int, threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # whole products, or on one thread block triangles of two (n = 20) or four (n = 45)
    # blocks over several chunks; blocks of 128 rows (n = 300) whatever the threads
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    g = torch.Generator().manual_seed(n)
    x = 3.0 + torch.randn(n, d, generator=g)  # a common component, as with full weights
    x[: n // 5] += 2.0 * torch.randn(n // 5, d, generator=g)  # some far updates
    ours = squared_distances(x)
    assert torch.equal(ours, ours.T) and bool((ours.diagonal() == 0).all())
    assert torch.allclose(ours, direct_distances(x), rtol=1e-5, atol=1e-6 * d)


def test_distances_of_tiny_deltas_on_huge_weights() -> None:
    g = torch.Generator().manual_seed(1)
    base = 1e4 * (1.0 + torch.rand(20_000, generator=g))
    x = base + 1e-2 * torch.randn(6, 20_000, generator=g)  # float32 full weights
    expected = direct_distances(x)  # of the float32 values as given
    assert torch.allclose(squared_distances(x), expected, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_other_dtypes_give_float32_results(dtype: torch.dtype) -> None:
    x = torch.randn(9, 300, generator=torch.Generator().manual_seed(2)).to(dtype)
    ref = x.double()
    assert torch.allclose(squared_distances(x), direct_distances(ref), rtol=1e-5, atol=1e-6)
    assert median(x).vector.dtype == torch.float32
    assert torch.allclose(median(x).vector, ref.median(dim=0).values.float())
    expected = ref.sort(dim=0).values[2:7].mean(dim=0).float()
    assert torch.allclose(trimmed_mean(x, f=2).vector, expected)


def test_sort_kernel_matches_torch_sort() -> None:
    x = torch.randn(13, 1000, generator=torch.Generator().manual_seed(3))
    x[:, ::7] = 0.0  # ties
    assert torch.equal(sorted_columns(x), torch.sort(x.T, dim=1).values)


def test_inputs_that_require_grad_are_fine() -> None:
    x = torch.randn(7, 10, requires_grad=True)
    for rule in RULES:
        params: dict[str, Any] = {"tau": 1.0} if rule == "centered_clipping" else {}
        assert torch.isfinite(aggregate(rule, x, f=1, **params).vector).all()


@pytest.mark.parametrize("kind", ["median", "trimmed"])
@pytest.mark.parametrize("values", ["gauss", "ties"])
@pytest.mark.parametrize("threads", [1, 3])
def test_numpy_and_torch_engines_agree(
    kind: str, values: str, threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the CPU engine (NumPy, chunks shared among threads) against the torch one (GPUs)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(11, 3_001, generator=g)
    if values == "ties":
        x = torch.randint(-2, 3, (11, 3_001), generator=g).float()
    out_np, rows_np = coordinatewise(x, kind, 3, 256, engine="numpy")
    out_t, rows_t = coordinatewise(x, kind, 3, 256, engine="torch")
    assert torch.equal(out_np, out_t)
    assert torch.allclose(rows_np, rows_t, rtol=0, atol=1e-9)
