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

import torch

from ._core import Aggregate, Decision, as_columns, chunk_width, pct, sort_budget
from ._select import coordinatewise
from .columns import Updates

_EPS = 1e-9  # coordinates; shares of tied runs are fractions


def median(updates: Updates) -> Aggregate:
    """Coordinate-wise median of the `(n, d)` updates (mean of the two middles for even n)."""
    source = as_columns(updates, "median")
    n, d = source.n, source.d
    middles = 2 if n % 2 == 0 else 1
    threads = torch.get_num_threads() if source.device.type == "cpu" else 1
    width = chunk_width(source, 8, sort_budget(source), threads)  # sorted copy, masks
    out, used = coordinatewise(source, "median", 0, width)  # used: middle positions held
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
