"""Federated averaging [McMahan et al., 2017, "Communication-Efficient Learning of Deep
Networks from Decentralized Data"].

    aggregate = sum_i w_i x_i / sum_i w_i

with `w_i` the given non-negative weights (for example example counts), uniform by default.
Not robust: one update can move the aggregate arbitrarily far.
"""

from __future__ import annotations

from torch import Tensor

from ._core import Aggregate, Decision, as_columns, check_weights, pct, weighted_sum
from .columns import Updates


def fedavg(updates: Updates, *, weights: Tensor | None = None) -> Aggregate:
    """Weighted mean of the `(n, d)` updates; `weights` `(n,)` >= 0, uniform when None.
    One pass over the updates (reading only those of positive weight)."""
    source = as_columns(updates, "fedavg")
    n = source.n
    w = check_weights(weights, n, "fedavg")  # (n,) float64, sums to 1
    vector = weighted_sum(source, w)
    return Aggregate(vector, fedavg_decisions(w.tolist()))


def fedavg_decisions(weights: list[float]) -> tuple[Decision, ...]:
    """What FedAvg did with each update, given the normalised weights (summing to 1)."""
    return tuple(
        Decision(
            selected=wi > 0.0,
            weight=wi,
            trimmed_share=0.0 if wi > 0.0 else 1.0,
            score=None,
            reason=f"averaged with weight {pct(wi)}" if wi > 0.0 else "weight zero, not averaged",
        )
        for wi in weights
    )
