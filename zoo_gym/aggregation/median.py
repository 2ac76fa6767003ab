"""Coordinate-wise median [Yin et al., 2018, "Byzantine-Robust Distributed Learning: Towards
Optimal Statistical Rates", ICML].

    aggregate[k] = median_i x_i[k]

For an even count the median is the mean of the two middle values (torch.median returns
the lower one instead). Computed over column chunks of the updates, each sorted along the
updates (see `_select`), so extra memory stays a few percent of the input whatever d is.
An update's weight is its mean share of the middle positions over the coordinates;
updates with equal values share the positions their run covers.
"""

from __future__ import annotations

from torch import Tensor

from ._core import Aggregate, Decision, check_updates, chunk_width, pct, sort_budget
from ._select import coordinatewise

_EPS = 1e-9  # coordinates; shares of tied runs are fractions


def median(updates: Tensor) -> Aggregate:
    """Coordinate-wise median of the `(n, d)` updates (mean of the two middles for even n)."""
    n, d = check_updates(updates, "median")
    middles = 2 if n % 2 == 0 else 1
    width = chunk_width(updates, 8, sort_budget(updates))  # sorted copy, masks
    out, used = coordinatewise(updates, "median", 0, width)  # used: middle positions held
    decisions = []
    for u in used.cpu().tolist():
        taken = min(1.0, u / d)  # share of coordinates in which it was a middle value
        decisions.append(
            Decision(
                selected=u > _EPS,
                weight=u / middles / d,
                trimmed_share=1.0 - taken,
                score=None,
                reason=f"the median in {pct(taken)} of coordinates",
            )
        )
    return Aggregate(out, tuple(decisions))
