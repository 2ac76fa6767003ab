"""Per-coordinate order statistics over column chunks `(n, c)` of the updates.

Shared by the coordinate-wise rules (median, trimmed mean, Bulyan). Each chunk is
transposed to `(c, n)` and sorted along the updates. Which update sits at which sorted
position is found by comparing the updates, in their own `(n, c)` layout, with the values
at the cut positions (a few elementwise passes, vectorised across the columns). That is
only ambiguous when values tie across a cut; then every update of the tied run gets an
equal share of the positions the run covers, so the per-update decisions do not depend on
the order of the updates.

Two engines compute the same numbers. On CPU: NumPy, whose vectorised sort (x86-simd-sort
on AVX-512/AVX2 machines) is several times faster per value than `torch.sort`,
`torch.topk` or `torch.kthvalue` over short columns; the chunks are handed out to
`torch.get_num_threads()` threads as they finish the previous one, each with its own
buffers and counts (NumPy releases the GIL), so no step waits on a barrier of all
threads, which keeps a busy shared machine from stalling the rule. The sort is most of
the time (for n = 50 about 1.7 ns per value against 0.4 ns for NumPy's sum over the rows
of the same data); the transpose, the comparisons and the counts (byte-wide, one add per
value) are the rest. On other devices: the same steps in torch.

Where the C extension `_orderstat` was built (`zoo_gym/aggregation/_orderstat.c`), the CPU
engine hands each chunk to it instead: it sorts tiles of 16 columns (AVX-512; 8 with AVX2)
with a sorting network across the rows, without a transpose, and forms the results and counts
while the tile is in cache, tie shares included (a chunk holding a NaN goes through the
NumPy steps above). Both give the same bits; `use_compiled(False)` turns it off.

A source over BitDelta payloads with float16 scales (one offering `sign_groups`) skips the
sort: the cut values, counts and tie shares come from each column's sign bits and its
group's sorted scales (`_signs`), the same bits again; `_signs.use_sign_structure(False)`
turns it off.

A zero median is +0.0 whatever the signs of the zeros it comes from (0.0 is added to the
mean of the middle values), so that it does not depend on where a sort puts -0.0 among
equal zeros; a trimmed mean's sum starts from +0.0 and is +0.0 when zero.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray
from torch import Tensor

from zoo_gym.core.extension import Extension

from . import _signs
from ._core import as_columns, run_threaded, sort_budget, spans
from .columns import Columns, SignPiece, Updates

Array = NDArray[Any]  # a NumPy array of the working dtype

_SUM_PIECE = 32_768  # values summed at once by `kept_sums`: torch's grain size, one thread


_COMPILED = Extension("zoo_gym.aggregation._orderstat")


def compiled_available() -> bool:
    """Whether the compiled kernels (`zoo_gym/aggregation/_orderstat.c`) were built and import."""
    return _COMPILED.available


def use_compiled(enabled: bool) -> bool:
    """Run the CPU engine's median and trimmed mean through the compiled kernels when
    `enabled` (and they were built), through NumPy otherwise; both give the same bits.
    Returns the previous setting."""
    return _COMPILED.use(enabled)


class Scratch:
    """Buffers of one call, reused by every column chunk of up to `width` columns, so that
    the heap does not grow with the number of chunks."""

    def __init__(self, n: int, width: int, dtype: torch.dtype, device: torch.device) -> None:
        self.dtype = dtype
        self.sorted = torch.empty((width, n), dtype=dtype, device=device)  # (c, n)
        self.values = torch.empty((n, width), dtype=dtype, device=device)  # (n, c)
        self.chunk = torch.empty((0, 0), dtype=dtype, device=device)  # (n, c) if converting
        self.acc = torch.empty(width, dtype=torch.float64, device=device)  # (c,)
        self.flags = torch.empty((2, width), dtype=torch.bool, device=device)  # (2, c)

    def load(self, x: Tensor) -> Tensor:
        """`x` `(n, c)` in the working dtype: itself if already so, else a reused copy."""
        if x.dtype == self.dtype:
            return x.detach()
        if self.chunk.numel() == 0:
            self.chunk = torch.empty_like(self.values)
        return self.chunk[:, : x.shape[1]].copy_(x.detach())


def sorted_columns(x: Tensor, out: Tensor | None = None) -> Tensor:
    """Each column of `x` `(n, c)` sorted ascending, as the rows of a `(c, n)` tensor (row k
    holds column k's values in order), written to `out` `(c, n)` when given."""
    n, c = x.shape
    out = torch.empty((c, n), dtype=x.dtype, device=x.device) if out is None else out
    out.copy_(x.detach().T)
    if out.device.type == "cpu":
        out.numpy().sort(axis=1)  # in place
        return out
    out.copy_(torch.sort(out, dim=1).values)
    return out


def kept_sums(kept: Tensor, out: Tensor) -> Tensor:
    """Write to `out` `(c,)` float64 the sum of each row of `kept` `(c, k)`, each row
    converted to float64 and summed by `torch.sum` (its order depends only on k, so a
    column's sum does not depend on the chunk it is in), and return `out`.

    In pieces of at most `_SUM_PIECE` values, each summed on the calling thread (below
    torch's parallel grain size): the NumPy engine calls it from its own threads."""
    c, k = kept.shape
    rows = max(1, _SUM_PIECE // max(1, k))
    for a in range(0, c, rows):
        b = min(c, a + rows)
        torch.sum(kept[a:b].to(torch.float64), dim=1, out=out[a:b])
    return out


def _overlap(below: Tensor, upto: Tensor, p: int, q: int) -> Tensor:
    """Share of a tied run covering sorted positions [below, upto) that lies in [p, q)."""
    inside = (torch.clamp(upto, max=q) - torch.clamp(below, min=p)).clamp(min=0)
    return inside.to(torch.float64) / (upto - below).to(torch.float64)


def window_shares(keys: Tensor, p: int, q: int, first: Tensor, last: Tensor) -> Tensor:
    """Share `(n, c)` float64 of each key in the sorted positions [p, q) of its column.

    `first` and `last` `(c,)` are the keys at sorted positions p and q - 1. A key strictly
    between them is wholly inside; a run of t equal keys covering positions [a, b) gives
    each of its members |[a, b) n [p, q)| / t. Each column's shares sum to q - p.
    """
    s_first = _overlap((keys < first).sum(0), (keys <= first).sum(0), p, q)  # (c,)
    s_last = _overlap((keys < last).sum(0), (keys <= last).sum(0), p, q)  # (c,)
    share = ((keys > first) & (keys < last)).to(torch.float64)
    share = torch.where(keys == last, s_last, share)
    return torch.where(keys == first, s_first, share)


def _ties(s: Tensor, pairs: list[tuple[int, int]], scratch: Scratch) -> Tensor:
    """`(c,)` bool: columns of the sorted `s` `(c, n)` in which any of the position pairs
    (a, a + 1) hold equal values, i.e. a cut between them splits a run of equal values."""
    c = s.shape[0]
    tie, other = scratch.flags[0, :c], scratch.flags[1, :c]
    tie.zero_()
    for a, b in pairs:
        torch.logical_or(tie, torch.eq(s[:, a], s[:, b], out=other), out=tie)
    return tie


def median_columns(x: Tensor, scratch: Scratch, out: Tensor) -> Tensor:
    """Write the per-column median of `x` `(n, c)` to `out` `(c,)` and return how many
    middle positions `(n,)` float64 each row holds, summed over the columns.

    The middle positions are lo = (n - 1) // 2 and hi = n // 2 (one position for odd n);
    the median is the mean of the values there, formed in float64, plus 0.0.
    """
    n, c = x.shape
    lo, hi = (n - 1) // 2, n // 2
    xs = scratch.load(x)  # (n, c)
    s = sorted_columns(xs, scratch.sorted[:c])  # (c, n)
    v_lo, v_hi = s[:, lo], s[:, hi]  # (c,)
    acc = scratch.acc[:c]
    acc.copy_(v_lo)
    out.copy_(acc.add_(v_hi).mul_(0.5).add_(0.0))  # + 0.0: a zero median is +0.0
    pairs = [(p, p + 1) for p in (lo - 1, hi) if p >= 0 and p + 1 < n]
    tie = _ties(s, pairs, scratch)
    # without a tie at the cuts, the rows holding the middle values are those in [v_lo, v_hi]
    middle = torch.clamp(xs, v_lo, v_hi, out=scratch.values[:, :c])
    torch.eq(middle, xs, out=middle)  # (n, c) 1.0 / 0.0, summed without a bool copy
    used = middle.sum(1).to(torch.float64)
    if bool(tie.any()):
        cols = torch.nonzero(tie).flatten()
        used -= middle[:, cols].sum(1).to(torch.float64)
        used += window_shares(xs[:, cols], lo, hi + 1, v_lo[cols], v_hi[cols]).sum(1)
    return used


def trimmed_columns(x: Tensor, f: int, scratch: Scratch, out: Tensor) -> Tensor:
    """Write to `out` `(c,)` the per-column mean of the values of `x` `(n, c)` left after
    dropping the f smallest and the f largest, and return each row's number `(n,)`
    float64 of dropped values. The kept values are summed in float64."""
    n, c = x.shape
    xs = scratch.load(x)  # (n, c)
    acc = scratch.acc[:c]
    if f == 0:
        acc.zero_()
        for row in xs:
            acc += row
        out.copy_(acc.div_(n))
        return torch.zeros(n, dtype=torch.float64, device=x.device)
    s = sorted_columns(xs, scratch.sorted[:c])  # (c, n)
    out.copy_(kept_sums(s[:, f : n - f], acc).div_(n - 2 * f))
    first, last = s[:, f], s[:, n - f - 1]  # smallest and largest kept values
    tie = _ties(s, [(f - 1, f), (n - f - 1, n - f)], scratch)
    # without a tie at the cuts, the dropped values are those outside [first, last]
    outside = torch.clamp(xs, first, last, out=scratch.values[:, :c])
    torch.ne(outside, xs, out=outside)  # (n, c) 1.0 / 0.0, summed without a bool copy
    dropped = outside.sum(1).to(torch.float64)
    if bool(tie.any()):
        cols = torch.nonzero(tie).flatten()
        dropped -= outside[:, cols].sum(1).to(torch.float64)
        share = window_shares(xs[:, cols], f, n - f, first[cols], last[cols])
        dropped += (1.0 - share).sum(1)
    return dropped


def closest_to_median(values: Tensor, beta: int) -> tuple[Tensor, Tensor]:
    """Mean `(c,)` float64 of the beta values of each column of `values` `(theta, c)`
    closest to the column's median, and each row's share `(theta,)` float64 of them.

    Where distances tie at the beta-th place, the tied values share the remaining places.
    A zero mean is +0.0, whatever the signs of the zeros it comes from.
    """
    theta, _ = values.shape
    v = values.to(torch.float64)
    s = sorted_columns(v)  # (c, theta)
    med = 0.5 * (s[:, (theta - 1) // 2] + s[:, theta // 2])  # (c,)
    gap = (v - med).abs()  # (theta, c)
    g = sorted_columns(gap)  # (c, theta)
    share = window_shares(gap, 0, beta, g[:, 0], g[:, beta - 1])  # (theta, c)
    return (share * v).sum(0) / beta + 0.0, share.sum(1)  # + 0.0: a zero mean is +0.0


# --- CPU engine: the same kernels on NumPy arrays, chunks shared out among threads ----------

_COUNT_LIMIT = 255  # chunks a uint8 tally takes before it is flushed


class _NpScratch:
    """NumPy buffers of one thread, reused by each of its chunks of up to `width` columns,
    and the thread's per-row totals.

    Per-row counts (rows holding a middle value, or values dropped) are tallied as uint8
    `(n, c)` masks added up chunk after chunk (one byte-wide add per value) and summed
    over the columns once every `_COUNT_LIMIT` chunks; shares of tied runs go straight
    to the float64 totals."""

    def __init__(self, n: int, width: int, dtype: type[np.floating[Any]]) -> None:
        self.sorted = np.empty((width, n), dtype=dtype)  # (c, n)
        self.mask = np.empty((2, n, width), dtype=np.bool_)  # (2, n, c)
        self.acc = np.empty(width, dtype=np.float64)  # (c,)
        self.tally = np.zeros((n, width), dtype=np.uint8)  # (n, c) counts since the flush
        self.tallied = 0  # chunks in `tally`
        self.totals = np.zeros(n, dtype=np.float64)  # (n,)
        self.counts = np.zeros(n, dtype=np.int64)  # (n,) counts since the last flush
        self.shares = np.empty(n, dtype=np.float64)  # (n,) tie shares of a compiled chunk
        self.ties = np.empty((0, 0), dtype=np.uint8)  # (n, c) codes of tie shares, if used
        work = 0 if _COMPILED.module is None else _COMPILED.module.work_size(n, width)
        self.work = np.empty(work, dtype=np.uint8)  # the compiled kernels' buffers

    def count(self, mask: NDArray[np.bool_]) -> None:
        """Add the `(n, c)` 0/1 `mask` to each row's count."""
        c = mask.shape[1]
        np.add(self.tally[:, :c], mask.view(np.uint8), out=self.tally[:, :c])
        self.tallied += 1
        if self.tallied == _COUNT_LIMIT:
            self._fold()

    def _fold(self) -> None:
        """Move the byte tallies into the int64 `counts`."""
        if self.tallied:
            self.counts += self.tally.sum(axis=1, dtype=np.int64)
            self.tally[...] = 0
            self.tallied = 0

    def flush(self) -> NDArray[np.float64]:
        """Add the counts to `totals` and return them. The float64 shares of tied runs went
        into `totals` chunk by chunk, the integer counts go in once at the end: the order in
        which the NumPy and the compiled kernels both add them."""
        self._fold()
        self.totals += self.counts
        self.counts[...] = 0
        return self.totals


def _np_sorted(x: Array, scratch: _NpScratch) -> Array:
    c = x.shape[1]
    s = scratch.sorted[:c]
    s[...] = x.T
    s.sort(axis=1)  # in place, vectorised
    return s


def _np_tie_shares(
    x: Array, tie: Array, p: int, q: int, first: Array, last: Array
) -> NDArray[np.float64]:
    """`window_shares` over the tied columns only, summed per row `(n,)`."""
    cols = np.flatnonzero(tie)
    keys = torch.from_numpy(np.ascontiguousarray(x[:, cols]))
    share = window_shares(keys, p, q, torch.from_numpy(first[cols]), torch.from_numpy(last[cols]))
    return np.asarray(share.sum(1).numpy(), dtype=np.float64)


def cut_positions(n: int, kind: str, f: int) -> list[int]:
    """The sorted positions `kind` reads in a column of n values: the first and last it
    keeps (median: the middles; trimmed: f and n - f - 1), with their outer neighbours
    (clipped to [0, n)), which say whether a run of equal values crosses a cut."""
    lo, hi = ((n - 1) // 2, n // 2) if kind == "median" else (f, n - f - 1)
    return [max(lo - 1, 0), lo, hi, min(hi + 1, n - 1)]


def _np_cuts(s: Array, positions: list[int]) -> Array:
    """The values `(k, c)` at `positions` of the sorted columns `s` `(c, n)`."""
    return np.ascontiguousarray(s[:, positions].T)


def _np_median(x: Array, scratch: _NpScratch, out: NDArray[np.float32]) -> None:
    """NumPy twin of `median_columns`: the medians go to `out`, the middle positions each
    row holds to the scratch's totals."""
    s = _np_sorted(x, scratch)
    median_at_cuts(x, _np_cuts(s, cut_positions(x.shape[0], "median", 0)), scratch, out)


def median_at_cuts(x: Array, cuts: Array, scratch: _NpScratch, out: NDArray[np.float32]) -> None:
    """`_np_median` of `x` `(n, c)` given its columns' values `cuts` `(4, c)` at the
    sorted `cut_positions`."""
    n, c = x.shape
    lo, hi = (n - 1) // 2, n // 2
    v_lo, v_hi = cuts[1], cuts[2]  # (c,) contiguous
    acc = scratch.acc[:c]
    np.add(v_lo, v_hi, out=acc, dtype=np.float64)
    out[...] = acc * 0.5 + 0.0  # + 0.0: a zero median is +0.0
    tie = np.zeros(c, dtype=np.bool_)
    if lo >= 1:
        tie |= cuts[0] == v_lo
    if hi + 1 < n:
        tie |= cuts[3] == v_hi
    middle, other = scratch.mask[0, :, :c], scratch.mask[1, :, :c]
    # without a tie at the cuts, the rows holding the middle values are those in [v_lo,
    # v_hi]; a tied column gets an empty range here and its shares below
    any_tie = bool(tie.any())
    low, high = v_lo, v_hi
    if any_tie:
        low, high = np.where(tie, np.inf, v_lo), np.where(tie, -np.inf, v_hi)
    if hi == lo:
        np.equal(x, low, out=middle)
    else:
        np.greater_equal(x, low, out=middle)
        np.logical_and(middle, np.less_equal(x, high, out=other), out=middle)
    scratch.count(middle)
    if any_tie:
        scratch.totals += _np_tie_shares(x, tie, lo, hi + 1, v_lo, v_hi)


def _np_trimmed(x: Array, f: int, scratch: _NpScratch, out: NDArray[np.float32]) -> None:
    """NumPy twin of `trimmed_columns`: the means go to `out`, the values each row has
    dropped to the scratch's totals."""
    n, c = x.shape
    acc = scratch.acc[:c]
    if f == 0:
        np.sum(x, axis=0, dtype=np.float64, out=acc)
        out[...] = acc / n
        return
    s = _np_sorted(x, scratch)
    kept_sums(torch.from_numpy(s[:, f : n - f]), torch.from_numpy(acc))
    trimmed_at_cuts(x, f, _np_cuts(s, cut_positions(n, "trimmed", f)), acc, scratch, out)


def trimmed_at_cuts(
    x: Array, f: int, cuts: Array, kept: Array, scratch: _NpScratch, out: NDArray[np.float32]
) -> None:
    """`_np_trimmed` of `x` `(n, c)` for f > 0 given its columns' values `cuts` `(4, c)` at
    the sorted `cut_positions` and the float64 sums `kept` `(c,)` of their kept values."""
    n, c = x.shape
    out[...] = kept / (n - 2 * f)
    first, last = cuts[1], cuts[2]  # smallest and largest kept values
    tie = (cuts[0] == first) | (cuts[3] == last)
    # without a tie at the cuts, the dropped values are those outside [first, last]; a
    # tied column gets an unbounded range here and its shares below
    any_tie = bool(tie.any())
    low, high = first, last
    if any_tie:
        low, high = np.where(tie, -np.inf, first), np.where(tie, np.inf, last)
    outside, other = scratch.mask[0, :, :c], scratch.mask[1, :, :c]
    np.logical_or(np.less(x, low, out=outside), np.greater(x, high, out=other), out=outside)
    scratch.count(outside)
    if any_tie:
        shares = _np_tie_shares(x, tie, f, n - f, first, last)
        scratch.totals += np.count_nonzero(tie) - shares


def _network(n: int, kind: str, f: int) -> bytes:
    """The compiled kernels' sorting network for the sorted positions `kind` reads: the
    middle ones (median) or the kept ones (trimmed), with their neighbours for the ties."""
    assert _COMPILED.module is not None
    lo, hi = ((n - 1) // 2, n // 2) if kind == "median" else (f, n - f - 1)
    network: bytes = _COMPILED.module.network(n, max(lo - 1, 0), min(hi + 1, n - 1))
    return network


def _c_rule(
    x: Array, kind: str, f: int, network: bytes, scratch: _NpScratch, out: NDArray[np.float32]
) -> None:
    """The compiled kernel of `kind` on `x` `(n, c)`: results to `out`, counts and tie shares
    to the scratch's, as the NumPy twin adds them; a chunk holding a NaN through the twin."""
    assert _COMPILED.module is not None
    if kind == "median":
        tied = _COMPILED.module.median(
            x, network, out, scratch.counts, scratch.shares, scratch.work
        )
    else:
        tied = _COMPILED.module.trimmed(
            x, f, network, out, scratch.counts, scratch.shares, scratch.work
        )
    if tied < 0:
        if kind == "median":
            _np_median(x, scratch, out)
        else:
            _np_trimmed(x, f, scratch, out)
    else:
        _c_tally(kind, tied, scratch)


def _sign_rule(
    x: Array, kind: str, f: int, cuts: Array, scratch: _NpScratch, out: NDArray[np.float32]
) -> None:
    """The NumPy twin's rule of `kind` on `x` `(n, c)` given the values `cuts` `(4, c)` at
    its columns' `cut_positions`, selected from sign bits (see `_signs`): results to `out`,
    counts and tie shares to the scratch's, as after a sort."""
    if kind == "median":
        median_at_cuts(x, cuts, scratch, out)
        return
    kept = scratch.acc[: x.shape[1]]
    _signs.kept_sums(x, f, cuts[1], cuts[2], kept)
    trimmed_at_cuts(x, f, cuts, kept, scratch, out)


# bytes after each row of tie codes: the AVX-512 kernel writes up to 32 past a span's last,
# and rows a multiple of 4 KiB apart would share the cache's sets
_TIE_PAD = 64


def _sign_chunk(
    compiled: ModuleType,
    pieces: Sequence[SignPiece],
    c: int,
    kind: str,
    f: int,
    scratch: _NpScratch,
    out: NDArray[np.float32],
) -> None:
    """The rule of `kind` over a range of c columns from its `pieces`, by the compiled
    kernels and without decoding it, in the spans of the scratch's width: results to `out`
    `(c,)`, counts and tie shares to the scratch's, as the sorting kernel adds them."""
    n, width = scratch.tally.shape
    if scratch.ties.shape != (n, width + _TIE_PAD):
        scratch.ties = np.empty((n, width + _TIE_PAD), dtype=np.uint8)
    row, table = np.empty(width, dtype=np.float64), np.empty(4 * width, dtype=np.float64)
    for a, b in spans(c, width):
        tied = _signs.rule_span(
            compiled, pieces, (a, b), kind, f, out[a:b], scratch.counts, scratch.ties, table
        )
        if tied:
            compiled.tie_rows(scratch.ties, table, tied, scratch.shares, row)
        _c_tally(kind, tied, scratch)


def _c_tally(kind: str, tied: int, scratch: _NpScratch) -> None:
    """Add the tie shares a compiled kernel left in the scratch (`tied` columns) to its
    totals, as the NumPy twin adds them."""
    if tied and kind == "median":
        scratch.totals += scratch.shares
    elif tied:
        scratch.totals += tied - scratch.shares


def np_closest_to_median(v: NDArray[np.float64], beta: int) -> tuple[Array, Array]:
    """NumPy twin of `closest_to_median` on `v` `(theta, c)` float64: the mean `(c,)`
    float64 and each row's share `(theta,)` float64.

    Where no distance ties at the beta-th place, the kept values are those at most the
    beta-th smallest distance from the median, each wholly; the tied columns go through
    `window_shares`. Each column's kept values (or shares x values) are added over the rows
    in order, as the compiled kernel adds them."""
    theta, c = v.shape
    s = np.sort(v.T, axis=1)  # (c, theta)
    med = 0.5 * (s[:, (theta - 1) // 2] + s[:, theta // 2])  # (c,)
    gap = np.abs(v - med)  # (theta, c)
    g = np.sort(gap.T, axis=1)  # (c, theta)
    last = g[:, beta - 1]
    keep = gap <= last  # (theta, c)
    mean = _rows_in_order(np.where(keep, v, 0.0))
    used = np.count_nonzero(keep, axis=1).astype(np.float64)
    tie = g[:, beta] == last if beta < theta else np.zeros(c, dtype=np.bool_)
    if tie.any():
        cols = np.flatnonzero(tie)
        keys = torch.from_numpy(np.ascontiguousarray(gap[:, cols]))
        first = torch.from_numpy(np.ascontiguousarray(g[cols, 0]))
        share = window_shares(keys, 0, beta, first, torch.from_numpy(last[cols])).numpy()
        used += share.sum(axis=1) - np.count_nonzero(keep[:, cols], axis=1)
        mean[cols] = _rows_in_order(share * v[:, cols])
    return mean / beta + 0.0, used  # + 0.0: a zero mean is +0.0


def _rows_in_order(x: NDArray[np.float64]) -> NDArray[np.float64]:
    """The sum `(c,)` of the rows of `x` `(theta, c)`, added one after the other from the
    first (NumPy's `sum(axis=0)` adds a single column pairwise instead)."""
    acc: NDArray[np.float64] = x[0].copy()
    for row in x[1:]:
        acc += row
    return acc


class Closest:
    """Bulyan's second step (`np_closest_to_median`) through the compiled kernel
    (`_orderstat.closest`) on spans of up to `width` columns of the theta chosen rows, for
    one thread: its sorting network, work buffer and the rows' counts. The means are the
    NumPy twin's bits; the per-row numbers agree to rounding (the tie shares are added in
    another order). A span holding a NaN goes through the twin."""

    def __init__(self, module: ModuleType, network: bytes, theta: int, width: int) -> None:
        self.module, self.network, self.theta, self.width = module, network, theta, width
        self.work = np.empty(module.work_size(theta, width), dtype=np.uint8)
        self.counts = np.zeros(theta, dtype=np.int64)
        self.shares = np.empty(theta, dtype=np.float64)
        self.total = np.zeros(theta, dtype=np.float64)

    @staticmethod
    def available() -> bool:
        """Whether the kernels are built and in use (`use_compiled`)."""
        return _COMPILED.enabled

    @classmethod
    def of(cls, theta: int, width: int) -> Closest | None:
        """One for a thread, or None where the kernels are not built or not in use."""
        module = _COMPILED.module if _COMPILED.enabled else None
        return (
            None
            if module is None
            else cls(module, module.network(theta, 0, theta - 1), theta, width)
        )

    def another(self) -> Closest:
        """A fresh one with its own buffers and counts (for another thread), the same network."""
        return Closest(self.module, self.network, self.theta, self.width)

    def span(
        self,
        x: Array,
        beta: int,
        out: NDArray[np.float32],
        rows: NDArray[np.int64] | None = None,
    ) -> None:
        """The means of the span `x` `(theta, c)` (float32 or float64), or of its `rows` in
        that order, into `out` `(c,)`."""
        tied = self.module.closest(
            x, beta, self.network, out, self.counts, self.shares, self.work, None, rows
        )
        if tied > 0:
            self.total += self.shares
        elif tied < 0:
            chosen = x if rows is None else x[rows]
            mean, share = np_closest_to_median(chosen.astype(np.float64), beta)
            out[:] = mean
            self.total += share

    def used(self) -> NDArray[np.float64]:
        """Each row's number `(theta,)` of columns it was kept in, tie shares included."""
        return self.total + self.counts


def coordinatewise(
    updates: Updates, kind: str, f: int, width: int, engine: str | None = None
) -> tuple[Tensor, Tensor]:
    """Run the `kind` ("median" or "trimmed") kernel over all column chunks of `width`
    columns, one pass: the `(d,)` float32 result and the per-row sums `(n,)` float64
    (middle positions held, or values dropped). `engine` "numpy" (CPU only) or "torch"; by
    default NumPy on CPU and torch elsewhere. The NumPy engine (the compiled kernels where
    built, see `use_compiled`) reads chunks from `torch.get_num_threads()` threads at
    once. A chunk wider than the sort budget (from a
    source with a budget, which decodes wide chunks) is sorted in spans of that budget,
    so the kernel's data stays in cache."""
    source = as_columns(updates, "coordinatewise")
    n, d, device = source.n, source.d, source.device
    engine = engine or ("numpy" if device.type == "cpu" else "torch")
    out = torch.empty(d, dtype=torch.float32, device=device)
    dtype = torch.float64 if source.dtype == torch.float64 else torch.float32
    inner = min(width, max(1, sort_budget(source) // (n * 8)))  # kernel columns
    if engine == "torch":
        scratch = Scratch(n, inner, dtype, device)
        rows = torch.zeros(n, dtype=torch.float64, device=device)
        for start, stop in spans(d, width):
            chunk = source.columns(start, stop)
            for a, b in spans(stop - start, inner):
                o = out[start + a : start + b]
                if kind == "median":
                    rows += median_columns(chunk[:, a:b], scratch, o)
                else:
                    rows += trimmed_columns(chunk[:, a:b], f, scratch, o)
            del chunk  # before the next is decoded
        return out, rows
    rows_np = _np_coordinatewise(source, kind, f, width, inner, out)
    return out, torch.from_numpy(rows_np)


def _np_coordinatewise(
    source: Columns, kind: str, f: int, width: int, inner: int, out: Tensor
) -> NDArray[np.float64]:
    """The NumPy engine of `coordinatewise`: chunks of `width` columns handed out to
    `torch.get_num_threads()` threads as they finish the previous one, each thread with
    its own buffers and counts; returns the per-row sums `(n,)` float64."""
    n, out_np = source.n, out.numpy()
    dtype = torch.float64 if source.dtype == torch.float64 else torch.float32
    np_dtype = np.float64 if dtype == torch.float64 else np.float32
    local = threading.local()
    buffers: list[_NpScratch] = []
    compiled = _COMPILED.enabled and (kind == "median" or f > 0)
    network = _network(n, kind, f) if compiled else b""
    signs = _signs.usable(source) if kind == "median" or f > 0 else None
    positions = cut_positions(n, kind, f)
    selector = _COMPILED.module if _COMPILED.enabled else None

    def run(span: tuple[int, int]) -> None:
        own = getattr(local, "buffers", None)
        if own is None:  # one per thread, kept for its later chunks
            own = local.buffers = _NpScratch(n, inner, np_dtype)
            buffers.append(own)
        start, stop = span
        pieces = None if signs is None else signs.sign_groups(start, stop)
        if pieces is not None and selector is not None:
            _sign_chunk(selector, pieces, stop - start, kind, f, own, out_np[start:stop])
            return
        if pieces is not None:
            cuts = _signs.cut_values(pieces, stop - start, positions)
        chunk = source.columns(start, stop).detach()
        x = chunk.numpy() if chunk.dtype == dtype else chunk.to(dtype).numpy()
        for a, b in spans(stop - start, inner):
            o = out_np[start + a : start + b]
            if pieces is not None:
                _sign_rule(x[:, a:b], kind, f, np.ascontiguousarray(cuts[:, a:b]), own, o)
            elif compiled:
                _c_rule(x[:, a:b], kind, f, network, own, o)
            elif kind == "median":
                _np_median(x[:, a:b], own, o)
            else:
                _np_trimmed(x[:, a:b], f, own, o)

    run_threaded(run, list(spans(source.d, width)), torch.get_num_threads())
    rows = np.zeros(n, dtype=np.float64)
    for own in buffers:
        rows += own.flush()
    return rows
