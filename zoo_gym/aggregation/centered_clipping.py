"""Centered clipping [Karimireddy, He and Jaggi, 2021, "Learning from History for Byzantine
Robust Optimization", ICML].

Starting from a centre v (the previous aggregate or momentum; zero by default), each of
`iters` steps moves v by the average of the updates' offsets clipped to radius tau:

    v <- v + (1/n) sum_i (x_i - v) min(1, tau / ||x_i - v||).

An update farther than tau from the centre pulls it by at most tau / n.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._core import Aggregate, Decision, check_updates, distances_to, pct, weighted_sum


def centered_clipping(
    updates: Tensor, *, tau: float, iters: int = 1, center: Tensor | None = None
) -> Aggregate:
    """Centered clipping of the `(n, d)` updates around `center` `(d,)` with radius tau."""
    n, d = check_updates(updates, "centered_clipping")
    if not tau > 0.0:
        raise ValueError(f"centered_clipping: tau must be > 0, got {tau}")
    if iters < 1:
        raise ValueError(f"centered_clipping: iters must be >= 1, got {iters}")
    if center is not None and tuple(center.shape) != (d,):
        raise ValueError(
            f"centered_clipping: center must have shape ({d},), got {tuple(center.shape)}"
        )
    v = (
        torch.zeros(d, dtype=torch.float32, device=updates.device)
        if center is None
        else center.to(updates.device, torch.float32).clone()
    )
    scale = torch.ones(n, dtype=torch.float64)
    dist = torch.zeros(n, dtype=torch.float64)
    for _ in range(iters):
        dist = distances_to(updates, v).cpu()  # (n,)
        scale = (tau / dist.clamp_min(1e-300)).clamp_max(1.0)  # (n,)
        # v + (1/n) sum_i s_i (x_i - v) = sum_i (s_i / n) x_i + (1 - sum_i s_i / n) v
        w = scale / n
        v = weighted_sum(updates, w) + (1.0 - float(w.sum())) * v
    decisions = tuple(
        Decision(
            selected=True,
            weight=si / n,
            trimmed_share=1.0 - si,
            score=di,
            reason=(
                f"clipped to {pct(si)} of its length (distance {di:.4g} > tau {tau:.4g})"
                if si < 1.0
                else f"within tau {tau:.4g} of the centre (distance {di:.4g})"
            ),
        )
        for si, di in zip(scale.tolist(), dist.tolist(), strict=True)
    )
    return Aggregate(v, decisions)
