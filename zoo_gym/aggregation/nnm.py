"""Nearest-neighbour mixing (NNM) [Allouah et al., 2023, "Fixing by Mixing: A Recipe for
Optimal Byzantine ML under Heterogeneity", AISTATS].

A pre-aggregation step: each update is replaced by the average of its n - f nearest
updates (itself included, Euclidean distance), then any robust rule runs on the mixed
updates. Row i of the result is derived from update i, so decisions stay aligned with the
original updates. Requires n > 2f.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._core import check_f, check_updates, column_chunks, require, squared_distances


def nnm(updates: Tensor, *, f: int) -> Tensor:
    """Mix each of the `(n, d)` updates with its n - f nearest neighbours; returns `(n, d)` float32."""
    n, d = check_updates(updates, "nnm")
    check_f(f, "nnm")
    require(n, 2 * f + 1, f"nnm with f={f}", "n > 2f")
    dist = squared_distances(updates)  # (n, n), zero diagonal
    dist.fill_diagonal_(-1.0)  # each update is its own nearest neighbour
    order = torch.sort(dist, dim=1, stable=True).indices[:, : n - f]  # (n, n - f)
    mix = torch.zeros((n, n), dtype=torch.float64, device=updates.device)
    mix.scatter_(1, order, 1.0 / (n - f))
    out = torch.empty((n, d), dtype=torch.float32, device=updates.device)
    for start, stop in column_chunks(updates, 16):
        out[:, start:stop] = mix @ updates[:, start:stop].to(torch.float64)
    return out
