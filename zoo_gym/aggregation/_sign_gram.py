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
a group at a time otherwise. With groups of 128 that is n^2 d / 256 pairs of groups of a few
operations each (a popcount of 128 bits, a few float64 operations), against the n^2 d / 2
multiply-adds of the float Gram product.

With float16 scales every term is exact in float64 (a, b, their difference and products are
multiples of 2^-48 below 2^42); the sums over groups round as any float64 sum does.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

import numpy as np
from numpy.typing import NDArray

from .columns import SignPiece

# packed bytes of one chunk's groups, all rows, at most (the heap reuses blocks this size)
CHUNK_BYTES = 8 << 20
BLOCK_BYTES = 1 << 20  # packed bytes of one block of groups, all rows: it stays in L2

# a chunk's groups in blocks: words (nb, n, w, block) uint64, scales (nb, n, block) and
# counts of values (nb, block) float64
Packed = tuple[NDArray[np.uint64], NDArray[np.float64], NDArray[np.float64]]


def chunk_width(n: int, group: int, budget: int | None) -> int:
    """Columns of one chunk for n rows in groups of `group`: its packed groups (8 bytes per
    64 values plus the scale, per row) within `CHUNK_BYTES` and a quarter of `budget`; whole
    groups, and a multiple of 1,024 columns above that."""
    per_group = n * 8 * (-(-group // 64) + 1)
    cap = CHUNK_BYTES if budget is None else max(1, min(CHUNK_BYTES, budget // 4))
    width = max(8, cap // per_group) * group
    return width - width % 1024 if width > 1024 else width


def empty(pieces: Sequence[SignPiece], n: int, previous: Packed | None = None) -> Packed:
    """Zeroed arrays for the groups of a chunk's `pieces` (see `fill`), in blocks of groups
    whose words and scales of all n rows take about `BLOCK_BYTES` (a multiple of 8 groups),
    the last block padded with empty groups; w words of 64 values per group. `previous`
    where it has the same shape and the same padding (every other place is filled again):
    its pages are already there."""
    groups = sum(piece.scales.shape[1] for piece in pieces)
    w = -(-max(min(p.group, p.stop - p.start) for p in pieces) // 64)
    block = max(8, BLOCK_BYTES // (n * 8 * (w + 1)) // 8 * 8)
    block = min(block, -(-groups // 8) * 8)
    nb = -(-groups // block)
    if (
        previous is not None
        and previous[0].shape == (nb, n, w, block)
        and not previous[2].reshape(-1)[groups:].any()  # no group of it past these
    ):
        return previous
    words = np.zeros((nb, n, w, block), dtype=np.uint64)
    return words, np.zeros((nb, n, block)), np.zeros((nb, block))


def fill(
    module: ModuleType, pieces: Sequence[SignPiece], packed: Packed, rows: tuple[int, int]
) -> None:
    """Pack rows [i0, i1) = `rows` of the chunk's `pieces` into `packed` (from `empty`) for
    `sign_distances` (`_passes.sign_pack`)."""
    words, values, sizes = packed
    g0 = 0
    for piece in pieces:
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
            *rows,
        )
        g0 += piece.scales.shape[1]
