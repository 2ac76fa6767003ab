"""Norm clipping of updates [as in Abadi et al., 2016, and in DP federated averaging,
McMahan et al., 2018]:

    x_i <- x_i * min(1, max_norm / ||x_i||).
"""

from __future__ import annotations

from typing import overload

import torch
from torch import Tensor

from ._core import as_columns, row_norms
from .columns import Columns, ScaledColumns, Updates


@overload
def clip_updates(updates: Tensor, *, max_norm: float) -> Tensor: ...


@overload
def clip_updates(updates: Columns, *, max_norm: float) -> Columns: ...


def clip_updates(updates: Updates, *, max_norm: float) -> Tensor | Columns:
    """Scale each of the `(n, d)` updates to L2 norm at most max_norm.

    A tensor gives the clipped `(n, d)` float32 tensor; a column source gives a source of
    the clipped updates (`ScaledColumns`), scaled chunk by chunk when read. One pass for
    the norms.
    """
    source = as_columns(updates, "clip_updates")
    if not max_norm > 0.0:
        raise ValueError(f"clip_updates: max_norm must be > 0, got {max_norm}")
    scale = (max_norm / row_norms(source).clamp_min(1e-300)).clamp_max(1.0)  # (n,)
    if not isinstance(updates, Tensor):
        return ScaledColumns(source, scale)
    return (updates.to(torch.float32) * scale.to(torch.float32)[:, None]).contiguous()
