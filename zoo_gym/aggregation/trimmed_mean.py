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

import torch

from ._core import (
    Aggregate,
    Decision,
    as_columns,
    check_f,
    chunk_width,
    pct,
    require,
    sort_budget,
)
from ._select import coordinatewise
from .columns import Updates

_EPS = 1e-9  # coordinates; shares of tied runs are fractions


def trimmed_mean(updates: Updates, *, f: int) -> Aggregate:
    """Per coordinate, the mean of the `(n, d)` updates after dropping the f lowest and f highest."""
    source = as_columns(updates, "trimmed_mean")
    n, d = source.n, source.d
    check_f(f, "trimmed_mean")
    require(n, 2 * f + 1, f"trimmed_mean with f={f}", "n > 2f")
    threads = torch.get_num_threads() if source.device.type == "cpu" else 1
    width = chunk_width(source, 8, sort_budget(source), threads)  # sorted copy, masks
    out, dropped = coordinatewise(source, "trimmed", f, width)  # dropped: coordinates
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
