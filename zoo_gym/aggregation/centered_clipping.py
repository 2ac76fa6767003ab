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

Passes. Two over the updates, whatever `iters` is. Every centre is an affine combination
of the start c and the updates, v = a_c c + sum_j a_j x_j with a_c + sum_j a_j = 1, so its
distance to each update follows from the pairwise squared distances D of the n + 1 points
{x_1, ..., x_n, c}:

    ||x_i - v||^2 = sum_p a_p D_ip - (1/2) sum_p sum_q a_p a_q D_pq.

One pass forms D (`_core.squared_distances` of the updates with c as one more row of the
shifted Gram matrix, accumulated in float64, the updates not copied); the steps then run on the (n + 1, n + 1)
matrix, keeping the coefficients a in float64; a last pass forms the centre once,
accumulated in float64 over the rows. Unlike a pass per step, each step's centre is not
rounded to float32 before the next. The common term of an outlier's distances (its own
squared length) cancels exactly in the formula because the coefficients sum to 1, so a far
update's tiny coefficient does not bring its size's rounding into the others' distances.
Above `_core.GRAM_STEPS_LIMIT` updates the (n + 1)^2 matrices would cost more than the passes, and
where a distance overflows the float32 products (values past about 1e19), the rule makes
iters + 1 passes instead: the distances to the start, then per step one
pass that forms the new centre and, but for the last step, the distances to it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._core import (
    GRAM_STEPS_LIMIT,
    Aggregate,
    Decision,
    as_columns,
    cached,
    check_count,
    combination_distances,
    combine,
    distances_to,
    pct,
    squared_distances,
)
from .columns import Columns, Updates


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
    start = None if center is None else center.detach().to(device, torch.float32)  # None: 0
    steps = _from_distances(source, start, tau, iters) if n <= GRAM_STEPS_LIMIT else None
    if steps is None:  # many updates, or distances past the range of float32 products
        v = torch.zeros(d, device=device) if start is None else start.clone()
        steps = _by_passes(source, v, tau, iters)
    v, scale, dist, radius = steps
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


def _radius(tau: float | None, dist: Tensor) -> float:
    """The clipping radius of a step: `tau`, or the median distance to the centre."""
    return float(tau) if tau is not None else _median(dist)


def _from_distances(
    source: Columns, start: Tensor | None, tau: float | None, iters: int
) -> tuple[Tensor, Tensor, Tensor, float] | None:
    """The steps on the pairwise distances of the updates and the start (see the module
    docstring; `start` None is the origin): (centre `(d,)` float32, last step's scales
    `(n,)`, its distances `(n,)`, its radius). Two passes over the source; None after the
    first when a distance is not finite (float32 products overflow past about 1e19 per
    value)."""
    n = source.n
    sq = squared_distances(source, "origin" if start is None else start).cpu()  # (n + 1,) * 2
    if not bool(torch.isfinite(sq).all()):
        return None
    coef = torch.zeros(n + 1, dtype=torch.float64)
    coef[n] = 1.0  # v = the start
    dist = sq[:n, n].sqrt()
    scale, radius = torch.ones(n, dtype=torch.float64), 0.0
    for step in range(iters):
        radius = _radius(tau, dist)
        scale = torch.where(dist <= radius, 1.0, radius / dist.clamp_min(1e-300))  # (n,)
        # v + (1/n) sum_i s_i (x_i - v) = sum_i (s_i / n) x_i + (1 - sum_i s_i / n) v
        w = scale / n
        coef = coef * (1.0 - float(w.sum()))
        coef[:n] += w
        if step < iters - 1:
            dist = combination_distances(sq, coef, n)
    v, _ = combine(source, coef[:n], base=start, base_weight=float(coef[n]), distances=False)
    return v, scale, dist, radius


def _by_passes(
    source: Columns, v: Tensor, tau: float | None, iters: int
) -> tuple[Tensor, Tensor, Tensor, float]:
    """The steps as passes over the source, one per step and one for the distances to the
    start: as `_from_distances` returns."""
    n = source.n
    scale = torch.ones(n, dtype=torch.float64)
    dist = distances_to(source, v).cpu()  # (n,)
    radius = 0.0
    for step in range(iters):
        radius = _radius(tau, dist)
        scale = torch.where(dist <= radius, 1.0, radius / dist.clamp_min(1e-300))  # (n,)
        w = scale / n
        last = step == iters - 1
        v, new = combine(source, w, base=v, base_weight=1.0 - float(w.sum()), distances=not last)
        if new is not None:  # distances to the new centre, for the next step
            dist = new.cpu()
    return v, scale, dist, radius


def _median(values: Tensor) -> float:
    """Median of a `(n,)` tensor (mean of the two middle values for even n)."""
    ordered = torch.sort(values).values
    n = ordered.numel()
    return 0.5 * float(ordered[(n - 1) // 2] + ordered[n // 2])
