"""Bulyan [El Mhamdi et al., 2018, "The Hidden Vulnerability of Distributed Learning in
Byzantium", ICML].

With n updates of which at most f are Byzantine (n >= 4f + 3):

1. Selection: theta = n - 2f updates are chosen by recursive Krum: score the remaining set
   with Krum (see `krum.krum_scores`), move the lowest-score update to the selection, repeat.
2. Aggregation: per coordinate, take the median of the theta selected values and average
   the beta = theta - 2f values closest to it.

Distances come from one float64 Gram matrix; step 2 runs over column chunks.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._core import (
    Aggregate,
    Decision,
    check_f,
    check_updates,
    column_chunks,
    pct,
    require,
    squared_distances,
)
from .krum import krum_scores, lowest


def recursive_krum(dist: Tensor, f: int, theta: int) -> list[int]:
    """Indices of the theta updates chosen one at a time by Krum on what remains."""
    remaining = list(range(dist.shape[0]))
    chosen: list[int] = []
    while len(chosen) < theta:
        idx = torch.tensor(remaining, device=dist.device)
        sub = dist[idx][:, idx]
        best = remaining[lowest(krum_scores(sub, f), 1, sub)[0]]
        chosen.append(best)
        remaining.remove(best)
    return chosen


def bulyan(updates: Tensor, *, f: int) -> Aggregate:
    """Bulyan over the `(n, d)` updates: recursive Krum, then a trimmed mean around the median."""
    n, d = check_updates(updates, "bulyan")
    check_f(f, "bulyan")
    require(n, 4 * f + 3, f"bulyan with f={f}", "n >= 4f + 3")
    theta, beta = n - 2 * f, n - 4 * f
    dist = squared_distances(updates)
    chosen = recursive_krum(dist, f, theta)
    sel = torch.tensor(chosen, device=updates.device)
    lo, hi = (theta - 1) // 2, theta // 2
    out = torch.empty(d, dtype=torch.float32, device=updates.device)
    used = torch.zeros(theta, dtype=torch.float64, device=updates.device)  # coordinates used
    for start, stop in column_chunks(updates, 40):
        values = updates[sel, start:stop].T.to(torch.float64)  # (c, theta)
        ordered = torch.sort(values, dim=1).values
        med = 0.5 * (ordered[:, lo] + ordered[:, hi])  # (c,)
        gap = (values - med[:, None]).abs()
        closest = torch.sort(gap, dim=1, stable=True).indices[:, :beta]  # (c, beta)
        out[start:stop] = torch.gather(values, 1, closest).mean(dim=1)
        used.index_add_(
            0,
            closest.flatten(),
            torch.ones(closest.numel(), dtype=torch.float64, device=used.device),
        )
    per_update = dict(zip(chosen, used.cpu().tolist(), strict=True))
    decisions = []
    for i in range(n):
        if i not in per_update:
            decisions.append(
                Decision(False, 0.0, 1.0, None, f"not among the {theta} updates chosen by Krum")
            )
            continue
        share = per_update[i] / d
        decisions.append(
            Decision(
                selected=share > 0.0,
                weight=share / beta,
                trimmed_share=1.0 - share,
                score=None,
                reason=f"chosen by Krum, trimmed in {pct(1.0 - share)} of coordinates",
            )
        )
    return Aggregate(out, tuple(decisions))
