"""Bulyan [El Mhamdi et al., 2018, "The Hidden Vulnerability of Distributed Learning in
Byzantium", ICML].

With n updates of which at most f are Byzantine (n >= 4f + 3):

1. Selection: theta = n - 2f updates are chosen by recursive Krum: score the remaining set
   with Krum (see `krum.krum_scores`), move the lowest-score update to the selection, repeat.
2. Aggregation: per coordinate, take the median of the theta selected values and average
   the beta = theta - 2f values closest to it. Where distances to the median tie at the
   beta-th place, the tied values share the remaining places equally (so the result does
   not depend on the order of the updates).

Distances come from the chunked Gram matrix of `_core.gram` (float64 accumulation); step 2
sorts column chunks of the selected updates in float64. Two passes over the updates: one
for the Gram matrix, one reading the theta selected rows.
"""

from __future__ import annotations

import numpy as np
import torch
from numpy.typing import NDArray
from torch import Tensor

from ._core import (
    Aggregate,
    Decision,
    as_columns,
    check_f,
    chunk_width,
    chunks,
    pct,
    require,
    run_threaded,
    sort_budget,
    spans,
    squared_distances,
    work_dtype,
)
from ._select import closest_to_median, np_closest_to_median
from .columns import Columns, Updates, cached
from .krum import krum_scores, lowest

_EPS = 1e-9  # coordinates; shares of tied runs are fractions


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


def _closest_to_median_pass(source: Columns, chosen: list[int], beta: int, out: Tensor) -> Tensor:
    """Step 2 over the chosen rows, one pass: write the `(d,)` aggregate to `out` and return
    each chosen row's number `(theta,)` float64 of coordinates it was kept in.

    On CPU the column ranges go to `torch.get_num_threads()` threads, each sorting its
    chunks with NumPy (see `_select`) in spans that fit the sort budget; elsewhere the
    torch kernel, chunk by chunk."""
    theta, device = len(chosen), source.device
    dtype = work_dtype(source)
    threads = torch.get_num_threads() if device.type == "cpu" else 1
    width = chunk_width(source, 48, sort_budget(source), threads)  # rows, gaps, shares
    if device.type != "cpu":
        used = torch.zeros(theta, dtype=torch.float64, device=device)
        for start, stop, rows in chunks(source, width, chosen):  # rows (theta, c)
            mean, share = closest_to_median(rows.to(dtype), beta)
            out[start:stop] = mean
            used += share
        return used
    out_np = out.numpy()

    inner = min(width, max(1, sort_budget(source) // (theta * 48)))  # kernel columns

    def run(span: tuple[int, int]) -> NDArray[np.float64]:
        rows = source.columns(span[0], span[1], chosen)  # (theta, c), chosen order
        total = np.zeros(theta, dtype=np.float64)
        for a, b in spans(span[1] - span[0], inner):  # in cache-sized spans
            v = rows[:, a:b].to(dtype).numpy().astype(np.float64)
            mean, share = np_closest_to_median(v, beta)
            out_np[span[0] + a : span[0] + b] = mean
            total += share
        return total

    parts = run_threaded(run, list(spans(source.d, width)), threads)
    total = np.zeros(theta, dtype=np.float64)
    for part in parts:
        total += part
    return torch.from_numpy(total)


def bulyan(updates: Updates, *, f: int) -> Aggregate:
    """Bulyan over the `(n, d)` updates: recursive Krum, then a trimmed mean around the median."""
    source = cached(as_columns(updates, "bulyan"))  # read more than once
    n, d, device = source.n, source.d, source.device
    check_f(f, "bulyan")
    require(n, 4 * f + 3, f"bulyan with f={f}", "n >= 4f + 3")
    theta, beta = n - 2 * f, n - 4 * f
    dist = squared_distances(source)
    chosen = recursive_krum(dist, f, theta)
    out = torch.empty(d, dtype=torch.float32, device=device)
    used = _closest_to_median_pass(source, chosen, beta, out)  # (theta,) coordinates
    per_update = dict(zip(chosen, used.cpu().tolist(), strict=True))
    decisions = []
    for i in range(n):
        if i not in per_update:
            decisions.append(
                Decision(False, 0.0, 1.0, None, f"not among the {theta} updates chosen by Krum")
            )
            continue
        share = min(1.0, per_update[i] / d)
        decisions.append(
            Decision(
                selected=per_update[i] > _EPS,
                weight=share / beta,
                trimmed_share=1.0 - share,
                score=None,
                reason=f"chosen by Krum, trimmed in {pct(1.0 - share)} of coordinates",
            )
        )
    return Aggregate(out, tuple(decisions))
