"""Coordinate-wise trimmed mean [Yin et al., 2018, "Byzantine-Robust Distributed Learning:
Towards Optimal Statistical Rates", ICML].

For each coordinate k, sort x_1[k], ..., x_n[k], drop the f smallest and the f largest and
average the remaining n - 2f values; requires n > 2f. (Flower's FedTrimmedAvg trims a
fraction beta instead: int(beta * n) from each side.) Computed over column chunks of the
updates, each sorted along the updates (see `_select`), so extra memory stays a few
percent of the input whatever d is. Where values tie at a cut, the tied updates share the
trimmed positions equally.
"""

from __future__ import annotations

from torch import Tensor

from ._core import (
    Aggregate,
    Decision,
    check_f,
    check_updates,
    chunk_width,
    pct,
    require,
    sort_budget,
)
from ._select import coordinatewise

_EPS = 1e-9  # coordinates; shares of tied runs are fractions


def trimmed_mean(updates: Tensor, *, f: int) -> Aggregate:
    """Per coordinate, the mean of the `(n, d)` updates after dropping the f lowest and f highest."""
    n, d = check_updates(updates, "trimmed_mean")
    check_f(f, "trimmed_mean")
    require(n, 2 * f + 1, f"trimmed_mean with f={f}", "n > 2f")
    width = chunk_width(updates, 8, sort_budget(updates))  # sorted copy, masks
    out, dropped = coordinatewise(updates, "trimmed", f, width)  # dropped: coordinates
    decisions = []
    for t in dropped.cpu().tolist():
        trimmed = min(1.0, max(0.0, t / d))
        decisions.append(
            Decision(
                selected=d - t > _EPS,
                weight=(1.0 - trimmed) / (n - 2 * f),
                trimmed_share=trimmed,
                score=None,
                reason=f"trimmed in {pct(trimmed)} of coordinates",
            )
        )
    return Aggregate(out, tuple(decisions))
