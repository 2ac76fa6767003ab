"""Update clipping to a global L2 norm [Abadi et al., 2016; McMahan et al., 2018].

``clip(x) = x * min(1, C / ||x||_2)`` with the norm taken over all tensors of the
update at once (DP-FedAvg's per-user clipping), accumulated in float64.
"""

from __future__ import annotations

import math

from zoo_gym.core.delta import Delta, delta_norm


def clip_delta(delta: Delta, max_norm: float) -> tuple[Delta, float]:
    """Scale `delta` by ``min(1, max_norm / ||delta||)``; return it and the original norm."""
    if not max_norm > 0 or not math.isfinite(max_norm):
        raise ValueError(f"max_norm must be a positive finite number, got {max_norm}")
    norm = delta_norm(delta)
    if not math.isfinite(norm):
        raise ValueError("the update has non-finite values; it cannot be clipped")
    factor = min(1.0, max_norm / norm) if norm > 0 else 1.0
    clipped = {
        name: (tensor.double() * factor).to(tensor.dtype) if factor < 1.0 else tensor.clone()
        for name, tensor in delta.items()
    }
    return clipped, norm


__all__ = ["clip_delta"]
