"""Nearest-neighbour mixing (NNM) [Allouah et al., 2023, "Fixing by Mixing: A Recipe for
Optimal Byzantine ML under Heterogeneity", AISTATS].

A pre-aggregation step: each update is replaced by the average of its n - f nearest
updates (itself included, Euclidean distance), then any robust rule runs on the mixed
updates. Row i of the result is derived from update i, so decisions stay aligned with the
original updates. Requires n > 2f.
"""

from __future__ import annotations

from typing import overload

import torch
from torch import Tensor

from ._core import (
    as_columns,
    cached,
    check_f,
    column_chunks,
    require,
    squared_distances,
)
from .columns import Columns, MixedColumns, TensorColumns, Updates


@overload
def nnm(updates: Tensor, *, f: int) -> Tensor: ...


@overload
def nnm(updates: Columns, *, f: int) -> Columns: ...


def nnm(updates: Updates, *, f: int) -> Tensor | Columns:
    """Mix each of the `(n, d)` updates with its n - f nearest neighbours.

    A tensor gives the mixed `(n, d)` float32 tensor. A column source gives a source of the
    mixed updates (`MixedColumns`), computed chunk by chunk when read, so nothing of size
    n x d is formed: one pass for the Gram matrix here, and each read of the result reads
    the source once more.
    """
    source = cached(as_columns(updates, "nnm"))  # read more than once
    n = source.n
    check_f(f, "nnm")
    require(n, 2 * f + 1, f"nnm with f={f}", "n > 2f")
    dist = squared_distances(source)  # (n, n), zero diagonal
    dist.fill_diagonal_(-1.0)  # each update is its own nearest neighbour
    order = torch.sort(dist, dim=1, stable=True).indices[:, : n - f]  # (n, n - f)
    mix = torch.zeros((n, n), dtype=torch.float64, device=source.device)
    mix.scatter_(1, order, 1.0 / (n - f))
    if isinstance(updates, TensorColumns) and updates.budget is None:
        return TensorColumns(nnm(updates.updates, f=f))  # the in-memory path
    if not isinstance(updates, Tensor):
        return MixedColumns(source, mix)
    out = torch.empty((n, source.d), dtype=torch.float32, device=source.device)
    for start, stop in column_chunks(updates, 16):
        out[:, start:stop] = mix @ updates[:, start:stop].to(torch.float64)
    return out
