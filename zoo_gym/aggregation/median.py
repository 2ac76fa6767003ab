"""Coordinate-wise median [Yin et al., 2018, "Byzantine-Robust Distributed Learning: Towards
Optimal Statistical Rates", ICML].

    aggregate[k] = median_i x_i[k]

For an even count the median is the mean of the two middle values (torch.median returns
the lower one instead). Computed over column chunks: each chunk is transposed to `(c, n)`
and sorted along the updates, so extra memory stays bounded whatever d is.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._core import Aggregate, Decision, check_updates, column_chunks, pct


def median(updates: Tensor) -> Aggregate:
    """Coordinate-wise median of the `(n, d)` updates (mean of the two middles for even n)."""
    n, d = check_updates(updates, "median")
    lo, hi = (n - 1) // 2, n // 2  # middle positions, equal for odd n
    out = torch.empty(d, dtype=torch.float32, device=updates.device)
    used = torch.zeros(n, dtype=torch.float64, device=updates.device)  # coordinate weights
    for start, stop in column_chunks(updates, 24):
        values, order = torch.sort(updates[:, start:stop].T.contiguous(), dim=1)  # (c, n)
        middle = values[:, lo : hi + 1].to(torch.float64)  # (c, 1 or 2)
        out[start:stop] = middle.mean(dim=1)
        share = 1.0 / (hi - lo + 1)
        used.index_add_(
            0, order[:, lo : hi + 1].flatten(), torch.full_like(middle, share).flatten()
        )
    decisions = []
    for u in used.cpu().tolist():
        taken = u / d  # mean weight per coordinate
        decisions.append(
            Decision(
                selected=u > 0.0,
                weight=taken,
                trimmed_share=1.0 - _count_share(u, d, hi - lo + 1),
                score=None,
                reason=f"the median in {pct(_count_share(u, d, hi - lo + 1))} of coordinates",
            )
        )
    return Aggregate(out, tuple(decisions))


def _count_share(used_weight: float, d: int, middles: int) -> float:
    """Share of coordinates in which an update was a middle value."""
    return min(1.0, used_weight * middles / d)
