"""Centered clipping [Karimireddy, He and Jaggi, 2021, "Learning from History for Byzantine
Robust Optimization", ICML].

Starting from a centre v (the previous aggregate or momentum; zero by default), each of
`iters` steps moves v by the average of the updates' offsets clipped to radius tau:

    v <- v + (1/n) sum_i (x_i - v) min(1, tau / ||x_i - v||).

An update farther than tau from the centre pulls it by at most tau / n.

Radius. With an explicit `tau` every step uses it. With `tau=None` (the default) each step
uses a data-driven radius, the median distance of the updates to the current centre,

    tau_t = median_i ||x_i - v_t||,

in the spirit of quantile-based adaptive clipping [Andrew, Thakkar, McMahan and
Ramaswamy, 2021, "Differentially Private Learning with Adaptive Clipping", NeurIPS],
whose default target is the median norm. With an honest majority (n >= 2f + 1) the
median distance is at most the distance of some honest update (the k-th smallest of all
distances is at most the k-th smallest honest one), so a Byzantine update, whatever its
size, moves the centre by at most tau_t / n with tau_t no larger than an honest update's
distance. A fixed point of the iteration is a Huber-type M-estimate of location,
sum_i (x_i - v) min(1, tau / ||x_i - v||) = 0. The radius
needs no tuning to the scale of the updates, which changes with the model, the learning
rate and the round.

Steps. Five by default: from a zero start the first step only reaches the bulk of the
updates and the next ones refine the centre. With a `center` from history one step is
what the paper analyses; pass `iters=1` for that.

Passes. iters + 1 over the updates: the distances to the start, then per step one pass
that forms the new centre chunk by chunk and, but for the last step, the distances to it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._core import (
    Aggregate,
    Decision,
    as_columns,
    check_count,
    combine,
    distances_to,
    pct,
)
from .columns import Updates, cached


def centered_clipping(
    updates: Updates,
    *,
    tau: float | None = None,
    iters: int = 5,
    center: Tensor | None = None,
) -> Aggregate:
    """Centered clipping of the `(n, d)` updates around `center` `(d,)` (zero by default).

    `tau`: clipping radius > 0, or None for the median distance to the centre at each
    step. `iters`: number of clipping steps (>= 1).
    """
    source = cached(as_columns(updates, "centered_clipping"))  # read more than once
    n, d, device = source.n, source.d, source.device
    if tau is not None and (isinstance(tau, bool) or not float(tau) > 0.0):
        raise ValueError(f"centered_clipping: tau must be > 0 or None (adaptive), got {tau!r}")
    iters = check_count(iters, "iters", "centered_clipping")
    if center is not None and tuple(center.shape) != (d,):
        raise ValueError(
            f"centered_clipping: center must have shape ({d},), got {tuple(center.shape)}"
        )
    v = (
        torch.zeros(d, dtype=torch.float32, device=device)
        if center is None
        else center.detach().to(device, torch.float32).clone()
    )
    scale = torch.ones(n, dtype=torch.float64)
    dist = distances_to(source, v).cpu()  # (n,)
    radius = 0.0
    for step in range(iters):
        radius = float(tau) if tau is not None else _median(dist)
        scale = torch.where(dist <= radius, 1.0, radius / dist.clamp_min(1e-300))  # (n,)
        # v + (1/n) sum_i s_i (x_i - v) = sum_i (s_i / n) x_i + (1 - sum_i s_i / n) v
        w = scale / n
        last = step == iters - 1
        v, new = combine(source, w, base=v, base_weight=1.0 - float(w.sum()), distances=not last)
        if new is not None:  # distances to the new centre, for the next step
            dist = new.cpu()
    what = "tau" if tau is not None else "the median distance"
    decisions = tuple(
        Decision(
            selected=si > 0.0,
            weight=si / n,
            trimmed_share=1.0 - si,
            score=di,
            reason=(
                f"clipped to {pct(si)} of its length (distance {di:.4g} > {what} {radius:.4g})"
                if si < 1.0
                else f"within {what} {radius:.4g} of the centre (distance {di:.4g})"
            ),
        )
        for si, di in zip(scale.tolist(), dist.tolist(), strict=True)
    )
    return Aggregate(v, decisions)


def _median(values: Tensor) -> float:
    """Median of a `(n,)` tensor (mean of the two middle values for even n)."""
    ordered = torch.sort(values).values
    n = ordered.numel()
    return 0.5 * float(ordered[(n - 1) // 2] + ordered[n // 2])
