"""Krum on updates that are small next to the weights.

With weights of magnitude 1e3 and deltas of 1e-3, ||x||^2 + ||y||^2 - 2 x.y in float32 on
the full weights (Flower's `compute_distances`) is dominated by rounding error and Krum
picks an attacker. Our distances come from a float64 Gram matrix of the centred updates
and pick the honest ones, given deltas or even full weights.
"""

from __future__ import annotations

import torch
from flwr.app import Array, ArrayRecord, MetricRecord, RecordDict
from flwr.serverapp.strategy.multikrum import select_multikrum

from zoo_gym.aggregation import krum


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
