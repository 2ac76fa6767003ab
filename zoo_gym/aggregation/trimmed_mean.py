"""Coordinate-wise trimmed mean [Yin et al., 2018, "Byzantine-Robust Distributed Learning:
Towards Optimal Statistical Rates", ICML].

For each coordinate k, sort x_1[k], ..., x_n[k], drop the f smallest and the f largest and
average the remaining n - 2f values; requires n > 2f. (Flower's FedTrimmedAvg trims a
fraction beta instead: int(beta * n) from each side.) Computed over column chunks, each
transposed to `(c, n)` and sorted, so extra memory stays bounded whatever d is.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._core import Aggregate, Decision, check_f, check_updates, column_chunks, pct, require


def trimmed_mean(updates: Tensor, *, f: int) -> Aggregate:
    """Per coordinate, the mean of the `(n, d)` updates after dropping the f lowest and f highest."""
    n, d = check_updates(updates, "trimmed_mean")
    check_f(f, "trimmed_mean")
    require(n, 2 * f + 1, f"trimmed_mean with f={f}", "n > 2f")
    out = torch.empty(d, dtype=torch.float32, device=updates.device)
    kept = torch.zeros(n, dtype=torch.float64, device=updates.device)  # coordinates kept
    for start, stop in column_chunks(updates, 24):
        values, order = torch.sort(updates[:, start:stop].T.contiguous(), dim=1)  # (c, n)
        out[start:stop] = values[:, f : n - f].to(torch.float64).mean(dim=1)
        inner = order[:, f : n - f].flatten()
        kept.index_add_(
            0, inner, torch.ones(inner.numel(), dtype=torch.float64, device=kept.device)
        )
    decisions = []
    for k in kept.cpu().tolist():
        trimmed = 1.0 - k / d
        decisions.append(
            Decision(
                selected=k > 0.0,
                weight=k / d / (n - 2 * f),
                trimmed_share=trimmed,
                score=None,
                reason=f"trimmed in {pct(trimmed)} of coordinates",
            )
        )
    return Aggregate(out, tuple(decisions))
