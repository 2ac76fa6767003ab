"""Pairwise distances of BitDelta updates from their sign bits, without decoding them.

In a BitDelta tensor update i's value at coordinate j is a sigma_ij, a = s(i, g) >= 0 the
update's scale of j's group g and sigma_ij = +-1 its sign (see `_signs`). Over a group of
`size` values, h of which differ in sign between updates i and k (scales a and b):

    sum over the group of (x_ij - x_kj)^2 = (size - h) (a - b)^2 + h (a + b)^2
                                          = size (a - b)^2 + 4 a b h

So ||x_i - x_k||^2 is a sum of non-negative terms, one per group: nothing cancels, however
much the updates share, and no shift is needed (the float Gram path shifts by a medoid for
that). h is the popcount of the XOR of the two rows' sign bits. The compiled kernels
(`_passes.sign_pack`, `_passes.sign_distances`) pack each chunk's groups into 64-bit words
and then add every pair's sum, 8 groups per AVX-512 step (VPOPCNTDQ) where the CPU has it,
a group at a time otherwise. Per pair and group it is a few operations on 128 bits, against
the 128 multiply-adds of the float Gram product: the work is n^2 d / 256 operations rather
than n^2 d / 2.

With float16 scales every term is exact in float64 (a, b, their difference and products are
multiples of 2^-48 below 2^42); the sums over groups round as any float64 sum does.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

import numpy as np
from numpy.typing import NDArray

from .columns import SignPiece

CHUNK_BYTES = 32 << 20  # packed bytes of one chunk's groups, all rows, at most

# a chunk's groups: words (n, w, ng) uint64, scales (n, ng) and counts of values (ng,) float64
Packed = tuple[NDArray[np.uint64], NDArray[np.float64], NDArray[np.float64]]


def chunk_width(n: int, group: int, budget: int | None) -> int:
    """Columns of one chunk for n rows in groups of `group`: its packed groups (8 bytes per
    64 values plus the scale, per row) within `CHUNK_BYTES` and a quarter of `budget`; whole
    groups, and a multiple of 1,024 columns above that."""
    per_group = n * 8 * (-(-group // 64) + 1)
    cap = CHUNK_BYTES if budget is None else max(1, min(CHUNK_BYTES, budget // 4))
    width = max(8, cap // per_group) * group
    return width - width % 1024 if width > 1024 else width


def pack(module: ModuleType, pieces: Sequence[SignPiece], n: int) -> Packed:
    """The groups of a chunk's `pieces` packed for `sign_distances`: words `(n, w, ng)`
    uint64 (w words of 64 values per group), the scales `(n, ng)` float64 and each group's
    count of values `(ng,)` float64, ng padded with empty groups to a multiple of 8."""
    counts = [piece.scales.shape[1] for piece in pieces]
    w = -(-max(min(p.group, p.stop - p.start) for p in pieces) // 64)
    ng = -(-sum(counts) // 8) * 8
    words = np.zeros((n, w, ng), dtype=np.uint64)
    values, sizes = np.zeros((n, ng)), np.zeros(ng)
    g0 = 0
    for piece, count in zip(pieces, counts, strict=True):
        module.sign_pack(
            piece.signs.numpy(),
            piece.bit,
            piece.stop - piece.start,
            piece.phase,
            piece.group,
            piece.scales.numpy(),
            words,
            values,
            sizes,
            g0,
        )
        g0 += count
    return words, values, sizes
