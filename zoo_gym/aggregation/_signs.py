"""Order statistics of BitDelta columns from their sign bits, without sorting the values.

In a BitDelta tensor, update i's value at coordinate j is -s(i, g) or +s(i, g), s(i, g)
>= 0 being update i's scale of j's group g (groups of consecutive values, aligned across
the n updates, which share one layout and group size). Within a group the n scales are the
same for every column; only the signs change. So the scales of a group are sorted once
(order r = 0..n-1 ascending), and each column's sorted values are its negatives' scales in
descending order, then its positives' in ascending order. With B(r) = 1 where the update
at place r of that order is negative in the column and C(r) = B(0) + ... + B(r), the update
at place r sits at sorted position

    N - C(r)            if it is negative (N = C(n - 1), the column's negatives)
    N + r - C(r)        if it is positive,

which is a permutation of 0..n-1. Equal scales and zero scales (+0.0 and -0.0 are equal
values) only reorder equal values, so the value at each position is the sorted one.

Two ways use it. The compiled kernel (`_orderstat.sign_rule`, through `rule_span`) sorts
each group's scales itself and forms everything a rule needs from the positions, without
decoding the chunk: the cut values, the kept sums, each row's count (its position inside
or outside the window) and, in the columns where a run of equal values crosses a cut, each
row's share as a code into the column's four possible shares, summed per row in
torch.sum's order (`tie_rows`), as the sorting kernel sums them. With AVX-512 it takes 32
columns at a time, each row's signs of them one mask (`use_sign_kernel` picks a kernel).
Without it, `cut_values` reads the four cut values of each column off the positions in
NumPy (a cumulative sum and a few elementwise passes) and the NumPy tie logic of `_select`
runs on the decoded chunk with them, as after a sort.

Only sources whose scales are float16 take this path (`usable`): their values, and any
sum of at most `MAX_ROWS` of them, are exact in float64 in any order, so a trimmed mean's
kept sum formed here equals the sorted path's bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import NDArray

from .columns import Columns, SignGroups, SignPiece

# rows up to which float16 values (multiples of 2^-24 below 2^16) sum exactly in float64
# in any order (n x 2^40 <= 2^53) and positions fit in int16
MAX_ROWS = 8192
_BLOCK = 1 << 18  # values of one block of groups, at most: its int16 arrays stay in L2

_ENABLED = [True]
_KERNEL: list[str | None] = [None]  # the compiled kernel's default: the fastest the CPU runs


def is_enabled() -> bool:
    """Whether the sign-bit paths are on (`use_sign_structure`)."""
    return _ENABLED[0]


def use_sign_structure(enabled: bool) -> bool:
    """Select order statistics of BitDelta sources from their sign bits when `enabled`,
    by sorting the decoded values otherwise; both give the same bits. Returns the
    previous setting."""
    previous = _ENABLED[0]
    _ENABLED[0] = enabled
    return previous


def use_sign_kernel(name: str | None) -> str | None:
    """Run the compiled selection with kernel `name` (one of `_orderstat.sign_kernels`; None
    for the fastest this CPU runs, the default). Every kernel gives the same bits. Returns
    the previous setting."""
    previous = _KERNEL[0]
    _KERNEL[0] = name
    return previous


def usable(source: Columns) -> SignGroups | None:
    """`source` where its order statistics can be selected from sign bits: it offers
    `sign_groups`, has at most `MAX_ROWS` rows and the path is on; None otherwise."""
    if not _ENABLED[0] or source.n > MAX_ROWS or source.device.type != "cpu":
        return None
    if getattr(source, "sign_groups", None) is None:
        return None
    signs: SignGroups = source  # type: ignore[assignment]  # has the optional method
    return signs


def cut_values(pieces: Sequence[SignPiece], c: int, positions: Sequence[int]) -> Any:
    """The values `(len(positions), c)` float32 at the sorted `positions` of each column
    of a range of c columns covered by `pieces` (a position may be repeated)."""
    distinct = sorted(set(positions))
    out = np.empty((len(distinct), c), dtype=np.float32)
    for ordered in sort_groups(pieces):
        piece = ordered.piece
        _piece_cuts(ordered, distinct, out[:, piece.start : piece.stop])
    if distinct == list(positions):
        return out
    return out[[distinct.index(p) for p in positions]]


def negatives(piece: SignPiece) -> NDArray[np.bool_]:
    """`(n, stop - start)`: True where the piece's value is negative (its sign bit clear)."""
    bits = np.unpackbits(piece.signs.numpy(), axis=1)
    negative: NDArray[np.bool_] = bits[:, piece.bit : piece.bit + piece.stop - piece.start] == 0
    return negative


def _piece_cuts(ordered: Sorted, positions: Sequence[int], out: NDArray[np.float32]) -> None:
    """`cut_values` of one piece, in blocks of whole groups of at most `_BLOCK` values."""
    piece, order, ascending = ordered
    negative = negatives(piece)
    n, groups = order.shape
    group, phase, m = piece.group, piece.phase, piece.stop - piece.start
    step = max(1, _BLOCK // (n * group))  # groups per block
    slots = np.full(n, -1, dtype=np.int8)  # the cut index of each sorted position, or -1
    slots[list(positions)] = np.arange(len(positions), dtype=np.int8)
    for g0 in range(0, groups, step):
        g1 = min(groups, g0 + step)
        c0, c1 = max(0, g0 * group - phase), min(m, g1 * group - phase)  # piece columns
        skip = c0 + phase - g0 * group  # block values before column c0
        signs = np.zeros((n, (g1 - g0) * group), dtype=np.bool_)
        signs[:, skip : skip + c1 - c0] = negative[:, c0:c1]
        signs = signs.reshape(n, g1 - g0, group)
        block = _block_cuts(order[:, g0:g1], ascending[:, g0:g1], signs, slots)
        out[:, c0:c1] = block[:, skip : skip + c1 - c0]


def _block_cuts(
    order: NDArray[np.int64],
    ascending: NDArray[np.float32],
    negative: NDArray[np.bool_],
    slots: NDArray[np.int8],
) -> NDArray[np.float32]:
    """Values `(k, groups * group)` at the cut positions (`slots`: position -> cut index
    or -1, k cuts) of each column of whole groups: `order` and `ascending` `(n, groups)`
    the groups' scale order and sorted scales (`sort_groups`), `negative` `(n, groups,
    group)`."""
    n, groups, group = negative.shape
    b = np.take_along_axis(negative, order[:, :, None], axis=0)  # (n, groups, group)
    below = np.cumsum(b, axis=0, dtype=np.int16)  # C(r)
    rank = np.arange(n, dtype=np.int16)[:, None, None]
    where = np.where(b, np.int16(0), rank)  # r for the positives
    where -= below
    where += below[-1]  # N - C(r), or N + r - C(r)
    r, g, j = np.nonzero(slots[where] >= 0)
    value = ascending[r, g]
    value = np.where(b[r, g, j], -value, value)
    k = int(np.count_nonzero(slots >= 0))
    out = np.empty((k, groups * group), dtype=np.float32)
    out[slots[where[r, g, j]], g * group + j] = value
    return out


def kept_sums(x: NDArray[np.float32], f: int, first: Any, last: Any, out: Any) -> None:
    """Write to `out` `(c,)` float64 the sum of each column of `x` `(n, c)` (float16
    values, n <= `MAX_ROWS`) over its sorted positions [f, n - f), whose values are
    `first` and `last` `(c,)`: every value minus those below `first` and above `last`,
    minus the copies of `first` (of `last`) at positions below f (from n - f on). Every
    partial sum is exact, so it equals the sum of the sorted values bit for bit (+0.0
    when zero)."""
    below, above = x < first, x > last  # (n, c)
    np.sum(x, axis=0, dtype=np.float64, out=out)
    out -= np.sum(x, axis=0, dtype=np.float64, where=below)
    out -= np.sum(x, axis=0, dtype=np.float64, where=above)
    out -= first.astype(np.float64) * (f - np.count_nonzero(below, axis=0))
    out -= last.astype(np.float64) * (f - np.count_nonzero(above, axis=0))
    out += 0.0  # a zero sum is +0.0, as the sorted path's


class Sorted(NamedTuple):
    """A piece with each of its groups' rows in ascending order of scale."""

    piece: SignPiece
    order: NDArray[np.int64]  # (n, groups)
    ascending: NDArray[np.float32]  # (n, groups)


def sort_groups(pieces: Sequence[SignPiece]) -> list[Sorted]:
    """Each piece with the order of its groups' scales (stable: equal scales keep the row
    order, which only orders equal values)."""
    out = []
    for piece in pieces:
        scales = piece.scales.numpy()
        order = np.argsort(scales, axis=0, kind="stable")  # (n, groups)
        out.append(Sorted(piece, order, np.take_along_axis(scales, order, axis=0)))
    return out


def rule_span(
    compiled: ModuleType,
    pieces: Sequence[SignPiece],
    span: tuple[int, int],
    kind: str,
    f: int,
    out: NDArray[np.float32],
    counts: NDArray[np.int64],
    ties: NDArray[np.uint8],
    table: NDArray[np.float64],
) -> int:
    """The rule of `kind` over columns [a, b) = `span` of the range `pieces` cover, by the
    compiled kernel (`_orderstat.sign_rule`, which sorts each group's scales itself) with
    no decoded values: results to `out` `(b - a,)`, each row's count of the untied columns
    to `counts` `(n,)`; for the t-th tied column, the shares a row may hold in it to
    `table[4 t : 4 t + 4]` float64 and each row's code of its share (an index into them)
    to `ties[:, t]` `(n, >= b - a)` uint8. Returns the number of tied columns."""
    a, b = span
    rule = 0 if kind == "median" else 1
    tied = 0
    for piece in pieces:
        s0, s1 = max(a, piece.start) - piece.start, min(b, piece.stop) - piece.start
        if s0 >= s1:
            continue
        group, at = piece.group, piece.phase + s0
        g0, g1 = at // group, (piece.phase + s1 - 1) // group + 1
        col0 = piece.start + s0 - a
        tied = compiled.sign_rule(
            piece.signs.numpy(),
            piece.bit + s0,
            s1 - s0,
            at % group,
            group,
            piece.scales.numpy()[:, g0:g1],
            rule,
            f,
            out[col0 : col0 + s1 - s0],
            counts,
            ties,
            table,
            tied,
            _KERNEL[0],
        )
    return tied
