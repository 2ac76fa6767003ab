"""Geometric median by smoothed Weiszfeld iterations, the robust aggregator RFA [Pillutla,
Kakade and Harchaoui, 2022, "Robust Aggregation for Federated Learning", IEEE TSP].

    z* = argmin_z sum_i a_i ||z - x_i||

with weights a_i >= 0 (uniform by default). Starting from the weighted mean, each step is

    b_i = a_i / max(eps, ||z - x_i||),    z <- sum_i b_i x_i / sum_i b_i,

where eps is the smoothing floor of RFA. Iteration stops after `iters` steps or when the
objective improves by less than a relative `tol`. Each step reads the updates once: the
new z and the distances to it come from the same pass over the column chunks.
"""

from __future__ import annotations

from torch import Tensor

from ._core import (
    Aggregate,
    Decision,
    as_columns,
    check_count,
    check_weights,
    combine,
    pct,
)
from .columns import Columns, Updates, cached


def geometric_median(
    updates: Updates,
    *,
    weights: Tensor | None = None,
    iters: int = 100,
    eps: float = 1e-8,
    tol: float = 1e-7,
) -> Aggregate:
    """Smoothed Weiszfeld (RFA) geometric median of the `(n, d)` updates; `weights` `(n,)` >= 0."""
    source = cached(as_columns(updates, "geometric_median"))  # read more than once
    n = source.n
    iters = check_count(iters, "iters", "geometric_median")
    if not eps > 0.0 or not tol >= 0.0:
        raise ValueError(
            f"geometric_median: need eps > 0 and tol >= 0, got eps={eps!r}, tol={tol!r}"
        )
    a = check_weights(weights, n, "geometric_median")  # (n,) float64
    z, dist = _step(source, a)  # (d,), (n,)
    objective = float((a * dist).sum())
    for _ in range(iters):
        b = a / dist.clamp_min(eps)
        b /= b.sum()
        z, dist = _step(source, b)
        new_objective = float((a * dist).sum())
        done = objective - new_objective <= tol * max(objective, eps)
        objective = new_objective
        if done:
            break
    b = a / dist.clamp_min(eps)
    b /= b.sum()
    decisions = tuple(
        Decision(
            selected=bi > 0.0,
            weight=bi,
            trimmed_share=0.0 if bi > 0.0 else 1.0,
            score=di,
            reason=f"weight {pct(bi)} at distance {di:.4g} from the geometric median",
        )
        for bi, di in zip(b.tolist(), dist.tolist(), strict=True)
    )
    return Aggregate(z, decisions)


def _step(source: Columns, weights: Tensor) -> tuple[Tensor, Tensor]:
    """z = sum_i weights[i] x_i `(d,)` and the distances `(n,)` float64 (CPU) to it, one pass."""
    z, dist = combine(source, weights)
    assert dist is not None
    return z, dist.cpu()
