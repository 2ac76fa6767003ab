"""Krum and Multi-Krum [Blanchard et al., 2017, "Machine Learning with Adversaries: Byzantine
Tolerant Gradient Descent", NeurIPS].

With n updates of which at most f are Byzantine, the score of update i is

    score(i) = sum of ||x_i - x_j||^2 over the n - f - 2 updates j != i closest to x_i,

which requires n >= 2f + 3. Krum returns the update with the lowest score; Multi-Krum
returns the plain average of the m lowest-score updates (m = 1 is Krum). Ties go to the
update with the smaller total distance to all others, then to the lower index.

Distances come from one Gram matrix of the updates shifted by a central update (the
medoid), computed chunk by chunk over d with float32 GEMMs accumulated in float64 (see
`_core.gram`), not from ||x||^2 + ||y||^2 - 2 x.y in float32 on full weights, which cancels
catastrophically when updates are small next to the weights. The m chosen updates are
averaged in float64 without copying them (one chosen update is copied as it is). Two
passes over the updates: one for the Gram matrix, one reading the m chosen rows for their
mean. The Gram matrix costs about n / 2 multiply-adds per value read, so from n of a few
dozen it is bound by the GEMM rate, not by reading the updates.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._core import (
    Aggregate,
    Decision,
    as_columns,
    cached,
    check_count,
    check_f,
    mean_of_rows,
    require,
    squared_distances,
)
from .columns import Updates

_SCORE_ROWS = 64  # rows of the distance matrix scored at a time


def krum_scores(dist: Tensor, f: int) -> Tensor:
    """Krum scores `(n,)` float64 from squared distances `dist` `(n, n)`.

    Each score sums the k = n - f - 2 smallest off-diagonal entries of its row; k is kept in
    [1, n - 1] so the recursion in Bulyan can score small remainders (k = 0 when n = 1).
    """
    n = dist.shape[0]
    k = min(max(n - f - 2, 1), n - 1)
    scores = torch.zeros(n, dtype=torch.float64, device=dist.device)
    if k == 0:
        return scores
    for r0 in range(0, n, _SCORE_ROWS):  # a few rows at a time: no (n, n) copy
        off = dist[r0 : r0 + _SCORE_ROWS].clone()  # (b, n)
        off.diagonal(offset=r0).fill_(float("inf"))
        nearest, _ = torch.topk(off, k, dim=1, largest=False)  # (b, k), ascending
        scores[r0 : r0 + off.shape[0]] = nearest.sum(dim=1)
    return scores


def lowest(scores: Tensor, m: int, dist: Tensor) -> list[int]:
    """Indices of the m lowest scores.

    Exact ties (a mutual nearest pair when n - f - 2 = 1) go to the update with the smaller
    total distance to all others, then to the lower index, so the choice does not depend on
    the order of the updates except in fully symmetric cases.
    """
    order = torch.sort(dist.sum(dim=1).cpu(), stable=True).indices
    order = order[torch.sort(scores.cpu()[order], stable=True).indices]
    return [int(i) for i in order[:m]]


def krum(updates: Updates, *, f: int, m: int = 1) -> Aggregate:
    """Multi-Krum [Blanchard et al., 2017]: average the m updates with the lowest scores.

    score(i) = sum of squared distances from update i to its n - f - 2 nearest neighbours.
    `updates` is (n, d); distances come from one float64 Gram matrix. Requires n >= 2f + 3
    and 1 <= m <= n. Every update's decision carries its score.
    """
    source = cached(as_columns(updates, "krum"))  # read more than once
    n = source.n
    check_f(f, "krum")
    require(n, 2 * f + 3, f"krum with f={f}", "n >= 2f + 3")
    m = check_count(m, "m", "krum")
    if m > n:
        raise ValueError(f"krum: m must be between 1 and n={n}, got {m}")
    dist = squared_distances(source)  # (n, n)
    scores = krum_scores(dist, f).cpu()  # (n,)
    chosen = lowest(scores, m, dist)
    vector = mean_of_rows(source, sorted(chosen))
    picked = set(chosen)
    what = "the lowest Krum score" if m == 1 else f"the {m} lowest Krum scores"
    decisions = tuple(
        Decision(
            selected=i in picked,
            weight=1.0 / m if i in picked else 0.0,
            trimmed_share=0.0 if i in picked else 1.0,
            score=float(s),
            reason=f"{'among' if i in picked else 'not among'} {what} (score {s:.4g})"
            if m > 1
            else f"{'has' if i in picked else 'not'} {what} (score {s:.4g})",
        )
        for i, s in enumerate(scores.tolist())
    )
    return Aggregate(vector, decisions)
