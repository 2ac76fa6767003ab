"""Norm clipping of updates [as in Abadi et al., 2016, and in DP federated averaging,
McMahan et al., 2018]:

    x_i <- x_i * min(1, max_norm / ||x_i||).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._core import check_updates, row_norms


def clip_updates(updates: Tensor, *, max_norm: float) -> Tensor:
    """Scale each of the `(n, d)` updates to L2 norm at most max_norm; returns `(n, d)` float32."""
    check_updates(updates, "clip_updates")
    if not max_norm > 0.0:
        raise ValueError(f"clip_updates: max_norm must be > 0, got {max_norm}")
    scale = (max_norm / row_norms(updates).clamp_min(1e-300)).clamp_max(1.0)  # (n,)
    return (updates.to(torch.float32) * scale.to(torch.float32)[:, None]).contiguous()
