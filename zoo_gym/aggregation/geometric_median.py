"""Geometric median by smoothed Weiszfeld iterations, the robust aggregator RFA [Pillutla,
Kakade and Harchaoui, 2022, "Robust Aggregation for Federated Learning", IEEE TSP].

    z* = argmin_z sum_i a_i ||z - x_i||

with weights a_i >= 0 (uniform by default). Starting from the weighted mean, each step is

    b_i = a_i / max(eps, ||z - x_i||),    z <- sum_i b_i x_i / sum_i b_i,

where eps is the smoothing floor of RFA. Iteration stops after `iters` steps or when the
objective improves by less than a relative `tol`. Up to `_core.GRAM_STEPS_LIMIT` updates the
steps run on the pairwise squared distances D of the updates (one pass): each z is an affine
combination sum_i b_i x_i, so ||x_i - z||^2 = (D b)_i - b^T D b / 2
(`_core.combination_distances`), and a last pass forms z. Above it, or where a distance
overflows the float32 products, each step reads the updates once: the new z and the distances
to it come from the same pass over the column chunks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ._core import (
    GRAM_STEPS_LIMIT,
    Aggregate,
    Decision,
    as_columns,
    cached,
    check_count,
    check_weights,
    combination_distances,
    combine,
    pct,
    squared_distances,
)
from .columns import Columns, Updates


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
    found = _on_distances(source, a, iters, eps, tol) if n <= GRAM_STEPS_LIMIT else None
    z, dist = found if found is not None else _by_passes(source, a, iters, eps, tol)
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


def _weiszfeld(
    a: Tensor, dist: Tensor, step: Callable[[Tensor], Tensor], iters: int, eps: float, tol: float
) -> tuple[Tensor, Tensor]:
    """Weiszfeld steps from the distances `dist` to the start: `step(b)` gives the distances
    to sum_i b_i x_i; returns the last step's weights b and the distances to its point."""
    objective = float((a * dist).sum())
    b = a
    for _ in range(iters):
        b = a / dist.clamp_min(eps)
        b /= b.sum()
        dist = step(b)
        new_objective = float((a * dist).sum())
        done = objective - new_objective <= tol * max(objective, eps)
        objective = new_objective
        if done:
            break
    return b, dist


def _on_distances(
    source: Columns, a: Tensor, iters: int, eps: float, tol: float
) -> tuple[Tensor, Tensor] | None:
    """The steps on the pairwise distances (one pass), then z (one more): (z, distances);
    None when a distance overflows the float32 products (values past about 1e19)."""
    sq = squared_distances(source).cpu()  # (n, n)
    if not bool(torch.isfinite(sq).all()):
        return None
    n = source.n
    b, dist = _weiszfeld(
        a,
        combination_distances(sq, a, n),
        lambda c: combination_distances(sq, c, n),
        iters,
        eps,
        tol,
    )
    z, _ = combine(source, b, distances=False)
    return z, dist


def _by_passes(
    source: Columns, a: Tensor, iters: int, eps: float, tol: float
) -> tuple[Tensor, Tensor]:
    """The steps as passes over the source, each forming z and the distances to it."""
    z, dist = _step(source, a)
    state = {"z": z}

    def step(b: Tensor) -> Tensor:
        state["z"], new = _step(source, b)
        return new

    _, dist = _weiszfeld(a, dist, step, iters, eps, tol)
    return state["z"], dist


def _step(source: Columns, weights: Tensor) -> tuple[Tensor, Tensor]:
    """z = sum_i weights[i] x_i `(d,)` and the distances `(n,)` float64 (CPU) to it, one pass."""
    z, dist = combine(source, weights)
    assert dist is not None
    return z, dist.cpu()
