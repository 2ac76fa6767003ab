"""Coordinate-wise median [Yin et al., 2018, "Byzantine-Robust Distributed Learning: Towards
Optimal Statistical Rates", ICML].

    aggregate[k] = median_i x_i[k]

For an even count the median is the mean of the two middle values (torch.median returns
the lower one instead). Computed over column chunks of the updates, each sorted along the
updates (see `_select.median_columns`), so extra memory stays a few percent of the input
whatever d is. An update's weight is its mean share of the middle positions over
the coordinates; updates with equal values share the positions their run covers.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._core import Aggregate, Decision, check_updates, chunk_width, pct, spans, work_dtype
from ._select import Scratch, median_columns

_EPS = 1e-9  # coordinates; shares of tied runs are fractions


def median(updates: Tensor) -> Aggregate:
    """Coordinate-wise median of the `(n, d)` updates (mean of the two middles for even n)."""
    n, d = check_updates(updates, "median")
    middles = 2 if n % 2 == 0 else 1
    width = chunk_width(updates, 8)  # sorted copy, clamped copy
    scratch = Scratch(n, width, work_dtype(updates), updates.device)
    out = torch.empty(d, dtype=torch.float32, device=updates.device)
    used = torch.zeros(n, dtype=torch.float64, device=updates.device)  # middle positions held
    for start, stop in spans(d, width):
        used += median_columns(updates[:, start:stop], scratch, out[start:stop])
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
