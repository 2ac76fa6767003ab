"""Bulyan [El Mhamdi et al., 2018, "The Hidden Vulnerability of Distributed Learning in
Byzantium", ICML].

With n updates of which at most f are Byzantine (n >= 4f + 3):

1. Selection: theta = n - 2f updates are chosen by recursive Krum: score the remaining set
   with Krum (see `krum.krum_scores`), move the lowest-score update to the selection, repeat.
2. Aggregation: per coordinate, take the median of the theta selected values and average
   the beta = theta - 2f values closest to it. Where distances to the median tie at the
   beta-th place, the tied values share the remaining places equally (so the result does
   not depend on the order of the updates).

Distances come from the chunked Gram matrix of `_core.gram` (float64 accumulation); step 1
sorts each row of distances once (see `recursive_krum`); step 2 sorts tiles of 16 columns of
the selected updates with a sorting network (the compiled kernel `_orderstat.closest`, which
reads an in-memory tensor's chosen rows where they lie; NumPy's sort where it was not built).
A zero result is +0.0. Two passes over the updates: one for the Gram matrix, one reading the
theta selected rows.
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
    cached,
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
from ._select import Closest, closest_to_median, np_closest_to_median
from .columns import Columns, TensorColumns, Updates
from .krum import lowest

_EPS = 1e-9  # coordinates; shares of tied runs are fractions


def recursive_krum(dist: Tensor, f: int, theta: int) -> list[int]:
    """Indices of the theta updates chosen one at a time by Krum on what remains.

    Each pick is `krum.lowest` of `krum.krum_scores` on the remaining updates, without
    re-scoring them all: every row's distances are sorted once, and each row keeps a pointer
    to the last of its k nearest remaining neighbours and the sum up to it, moved as
    updates leave and k shrinks (O(n^2 log n) in all instead of O(n^3 log n)). The running
    sums, within a bound on their rounding, only shortlist the rows that may score lowest;
    those are scored again exactly as `krum_scores` does and ties broken as `lowest` does,
    so the picks are the same as re-scoring the remainder each time.
    """
    n = dist.shape[0]
    if theta <= 0:
        return []
    full = dist.detach().to("cpu", torch.float64)
    walk = _SortedRows(full.numpy())
    alive = np.ones(n, dtype=np.bool_)
    chosen: list[int] = []
    for size in range(n, n - theta, -1):  # size: updates remaining before this pick
        k = min(max(size - f - 2, 1), size - 1)
        walk.fit(k, alive)
        best = _pick(full, walk, alive, k)
        chosen.append(best)
        alive[best] = False
        walk.drop(best, alive)
    return chosen


class _SortedRows:
    """Each row's distances to the others in ascending order (own distance last), with a
    pointer `last` to its k-th nearest remaining neighbour, `count` such neighbours up to
    and including it, `total` the running sum of their distances and `mass` the sum of every
    distance ever added to it (which bounds its rounding: `error`)."""

    def __init__(self, dist: NDArray[np.float64]) -> None:
        n = dist.shape[0]
        off = dist.copy()
        np.fill_diagonal(off, np.inf)
        self.order = np.argsort(off, axis=1, kind="stable")  # (n, n)
        self.sorted = np.take_along_axis(off, self.order, axis=1)  # (n, n)
        self.rank = np.empty_like(self.order)  # rank[i, j]: position of j in row i
        np.put_along_axis(self.rank, self.order, np.arange(n)[None, :].repeat(n, 0), axis=1)
        self.last = np.full(n, -1, dtype=np.int64)
        self.count = np.zeros(n, dtype=np.int64)
        self.total = np.zeros(n, dtype=np.float64)
        self.mass = np.zeros(n, dtype=np.float64)
        self.rows = np.arange(n)

    def error(self, rows: NDArray[np.int64]) -> NDArray[np.float64]:
        """A bound on the rounding of `total` for `rows`: each of at most 2n additions and
        subtractions is off by at most half an ulp of the largest sum it saw."""
        return (4 * self.rows.size * np.finfo(np.float64).eps) * self.mass[rows]

    def drop(self, r: int, alive: NDArray[np.bool_]) -> None:
        """Update r has left: rows that counted it lose it from their sums."""
        inside = alive & (self.rank[:, r] <= self.last)
        self.total[inside] -= self.sorted[inside, self.rank[inside, r]]
        self.count[inside] -= 1
        moved = inside & (self.rank[:, r] == self.last)  # r was the last: step back
        self._step(moved, alive, -1, add=False)

    def fit(self, k: int, alive: NDArray[np.bool_]) -> None:
        """Move every remaining row's pointer until it counts its k nearest neighbours."""
        while True:
            fewer = alive & (self.count < k)
            more = alive & (self.count > k)
            if not fewer.any() and not more.any():
                return
            if more.any():
                self.total[more] -= self.sorted[more, self.last[more]]
                self.count[more] -= 1
                self._step(more, alive, -1, add=False)
            if fewer.any():
                self._step(fewer, alive, 1, add=True)
                self.count[fewer] += 1

    def _step(self, rows: NDArray[np.bool_], alive: NDArray[np.bool_], way: int, add: bool) -> None:
        """Move the pointers of `rows` by `way` to the next remaining neighbour (or to -1);
        with `add`, add its distance to the sums."""
        idx = self.rows[rows]
        pos = self.last[idx] + way
        while idx.size:
            ok = pos < 0
            ok |= alive[self.order[idx, np.clip(pos, 0, None)]]
            done, pos_done = idx[ok], pos[ok]
            self.last[done] = pos_done
            if add:
                value = self.sorted[done, pos_done]
                self.total[done] += value
                self.mass[done] += value
            idx, pos = idx[~ok], pos[~ok] + way


def _pick(full: Tensor, walk: _SortedRows, alive: NDArray[np.bool_], k: int) -> int:
    """The remaining update with the lowest Krum score, as `lowest(krum_scores(...), 1)`
    on the remainder picks it: exact scores, ties to the smaller total distance to the
    remaining updates, then to the lower index."""
    remaining = np.flatnonzero(alive)
    if k == 0 or remaining.size == 1:
        return int(remaining[0])  # all scores are 0: the tie-break decides, see below
    total, error = walk.total[remaining], walk.error(remaining)
    near = remaining[total - error <= (total + error).min()]  # surely holds the lowest
    if near.size == 1:
        return int(near[0])
    exact = []
    for i in near:  # the k smallest remaining distances, in ascending order
        upto = walk.order[i, : walk.last[i] + 1]
        values = walk.sorted[i, : walk.last[i] + 1][alive[upto]]
        exact.append(torch.from_numpy(np.ascontiguousarray(values)))
    scores = torch.stack(exact).sum(dim=1)  # as krum_scores sums its (n, k) top-k
    sub = full[torch.from_numpy(near)][:, torch.from_numpy(remaining)]
    return int(near[lowest(scores, 1, sub)[0]])


_CHUNKS_PER_GROUP = 64  # chunks of the closest-to-median pass handed to a thread at once, at most
_CLOSEST_SPAN = 1 << 16  # columns per call of the compiled kernel (its work: 48 bytes each)
# bytes of chosen rows a thread decodes at a time for the compiled kernel (n = 50, d = 10M
# from payloads: 8 MiB peaked at 200 MiB, 4 MiB at 125 MiB, as fast)
_DECODED = 4 << 20
_ALIGN = 1024  # columns: decoded ranges of packed payloads start on whole bytes and groups


def _pass_widths(source: Columns, theta: int, threads: int, compiled: bool) -> tuple[int, int]:
    """Columns of a chunk of the closest-to-median pass, and of a span of a kernel call.

    The compiled kernel sorts tiles of 16 columns in cache whatever the chunk: chunks of the
    default share of an in-memory input (fewer calls), and `_DECODED` bytes of chosen rows
    from a source that decodes them. NumPy's sort needs its temporaries to stay in cache."""
    if not compiled:
        width = chunk_width(source, 48, sort_budget(source), threads)  # rows, gaps, shares
        return width, min(width, max(1, sort_budget(source) // (theta * 48)))
    width = chunk_width(source, 4, parallel=threads)
    if not isinstance(source, TensorColumns):
        width = min(width, max(_ALIGN, _DECODED // (theta * 4) // _ALIGN * _ALIGN))
    return width, min(width, _CLOSEST_SPAN)


def _closest_to_median_pass(source: Columns, chosen: list[int], beta: int, out: Tensor) -> Tensor:
    """Step 2 over the chosen rows, one pass: write the `(d,)` aggregate to `out` and return
    each chosen row's number `(theta,)` float64 of coordinates it was kept in.

    On CPU the column ranges go to `torch.get_num_threads()` threads, each sorting its
    chunks in spans that fit the sort budget, through the compiled kernel where it was built
    (`_select.Closest`), with NumPy otherwise; elsewhere the torch kernel, chunk by chunk."""
    theta, device = len(chosen), source.device
    dtype = work_dtype(source)
    threads = torch.get_num_threads() if device.type == "cpu" else 1
    compiled = device.type == "cpu" and Closest.available()
    width, inner = _pass_widths(source, theta, threads, compiled)
    if device.type != "cpu":
        used = torch.zeros(theta, dtype=torch.float64, device=device)
        for start, stop, rows in chunks(source, width, chosen):  # rows (theta, c)
            mean, share = closest_to_median(rows.to(dtype), beta)
            out[start:stop] = mean
            used += share
            del rows, mean  # before the next chunk is decoded
        return used
    out_np = out.numpy()
    # an in-memory tensor's chosen rows are read where they are, by the kernel
    in_place = compiled and isinstance(source, TensorColumns) and source.dtype == dtype
    picked = np.asarray(chosen, dtype=np.int64) if in_place else None
    first = Closest.of(theta, inner) if compiled else None  # its network serves every group

    def run(group: list[tuple[int, int]]) -> NDArray[np.float64]:
        closest = None if first is None else first.another()
        total = np.zeros(theta, dtype=np.float64)
        for start, stop in group:
            rows = source.columns(start, stop, None if in_place else chosen)  # chosen order
            for a, b in spans(stop - start, inner):  # in cache-sized spans
                v = rows[:, a:b].to(dtype).numpy()
                if closest is not None:
                    closest.span(v, beta, out_np[start + a : start + b], picked)
                    continue
                mean, share = np_closest_to_median(v.astype(np.float64), beta)
                out_np[start + a : start + b] = mean
                total += share
        return total if closest is None else closest.used()

    # the chunks in groups of a fixed count, each group's counts summed apart and the groups
    # added in order (one (theta,) total per chunk held 150 MB at n = 1,000, d = 1M)
    ranges = list(spans(source.d, width))
    # at most 64 a group, and at least 4 groups a thread where there are chunks enough
    size = max(1, min(_CHUNKS_PER_GROUP, len(ranges) // (4 * threads)))
    groups = [ranges[k : k + size] for k in range(0, len(ranges), size)]
    parts = run_threaded(run, groups, threads)
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
