"""Triton kernels for BitDelta (Liu et al., 2024): pack, unpack/accumulate, apply to weights.

Bit layout as in `zoo_gym.compression.bitdelta`: value ``8i + j`` is bit ``7 - j`` of byte
``i``, 1 for ``>= 0``; scale ``k`` covers values ``[k * group, (k + 1) * group)``.
"""

# mypy: disable-error-code="untyped-decorator,no-untyped-def"

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

_BLOCK = 1024  # values per program of the element-wise kernels
_PACK_ROWS = 64  # groups per program of the pack kernel
# No fused multiply-add: +-(weight * scale) is rounded before it is added, as on the CPU.
_EXACT = {"enable_fp_fusion": False}


@triton.jit
def _vector(x_ptr, bits_ptr, start, v, n, ok, lane):
    # Vector v (values 8v .. 8v + 7) of each group in a (ROWS, 8) tile: stores its sign byte
    # and returns |x| (0 past the end of the tensor).
    idx = start[:, None] + v * 8 + lane[None, :]
    valid = ok[:, None] & (idx < n)
    x = tl.load(x_ptr + idx, mask=valid, other=0.0)
    bits = ((x >= 0) & valid).to(tl.int32) << (7 - lane)[None, :]
    first = start + v * 8
    tl.store(bits_ptr + first // 8, tl.sum(bits, axis=1).to(tl.uint8), mask=ok & (first < n))
    return tl.abs(x)


@triton.jit
def _pack_kernel(x_ptr, bits_ptr, scale_ptr, n, n_groups, GROUP: tl.constexpr, ROWS: tl.constexpr):
    # ROWS groups per program. The sum of |x| over a group follows PyTorch's CPU sum of a
    # contiguous float32 row (`cascade_sum`, 8-lane vectors) add for add; see `pack`.
    VECS: tl.constexpr = GROUP // 8
    QUADS: tl.constexpr = VECS // 4
    g = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    lane = tl.arange(0, 8)
    start = g * GROUP
    ok = g < n_groups
    zero = tl.zeros((ROWS, 8), dtype=tl.float32)
    o0, o1, o2, o3 = zero, zero, zero, zero  # level 1 of the cascade: sums of blocks
    for b in range(QUADS // 16):  # blocks of 16 quads (64 vectors) go to level 0, then up
        a0, a1, a2, a3 = zero, zero, zero, zero
        for j in tl.static_range(16):
            v = (b * 16 + j) * 4
            a0 += _vector(x_ptr, bits_ptr, start, v, n, ok, lane)
            a1 += _vector(x_ptr, bits_ptr, start, v + 1, n, ok, lane)
            a2 += _vector(x_ptr, bits_ptr, start, v + 2, n, ok, lane)
            a3 += _vector(x_ptr, bits_ptr, start, v + 3, n, ok, lane)
        o0, o1, o2, o3 = o0 + a0, o1 + a1, o2 + a2, o3 + a3
    p0, p1, p2, p3 = zero, zero, zero, zero  # level 0: the quads after the last whole block
    for j in tl.static_range(QUADS % 16):
        v = ((QUADS // 16) * 16 + j) * 4
        p0 += _vector(x_ptr, bits_ptr, start, v, n, ok, lane)
        p1 += _vector(x_ptr, bits_ptr, start, v + 1, n, ok, lane)
        p2 += _vector(x_ptr, bits_ptr, start, v + 2, n, ok, lane)
        p3 += _vector(x_ptr, bits_ptr, start, v + 3, n, ok, lane)
    p0, p1, p2, p3 = p0 + o0, p1 + o1, p2 + o2, p3 + o3
    for v in tl.static_range(QUADS * 4, VECS):  # the vectors after the last whole quad
        p0 += _vector(x_ptr, bits_ptr, start, v, n, ok, lane)
    p0 = ((p0 + p1) + p2) + p3
    total = tl.zeros((ROWS,), dtype=tl.float32)
    for k in tl.static_range(8):  # the lanes in order (a sum of one lane and zeros is exact)
        total += tl.sum(tl.where(lane[None, :] == k, p0, 0.0), axis=1)
    count = tl.maximum(tl.minimum(n - start, GROUP), 1).to(tl.float32)  # 1: rows past the end
    tl.store(scale_ptr + g, tl.div_rn(total, count), mask=ok)


@triton.jit
def _unpack_kernel(
    bits_ptr, scale_ptr, out_ptr, n, group, weight, ACCUMULATE: tl.constexpr, BLOCK: tl.constexpr
):
    # out[i] (+)= +-(weight * scale[i // group]); one program per BLOCK values.
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = idx < n
    byte = tl.load(bits_ptr + idx // 8, mask=valid, other=0).to(tl.int32)
    bit = (byte >> (7 - idx % 8)) & 1
    step = tl.load(scale_ptr + idx // group, mask=valid, other=0.0) * weight
    value = tl.where(bit != 0, step, -step)
    if ACCUMULATE:
        value = tl.load(out_ptr + idx, mask=valid, other=0.0) + value
    tl.store(out_ptr + idx, value, mask=valid)


@triton.jit
def _apply_kernel(
    w_ptr, bits_ptr, scale_ptr, n, group, alpha, BF16: tl.constexpr, BLOCK: tl.constexpr
):
    # w[i] = round_to_dtype(float32(w[i]) +- alpha * scale[i // group]), in place. bfloat16 is
    # rounded to nearest even with integer arithmetic, identical on GPUs and the interpreter.
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = idx < n
    byte = tl.load(bits_ptr + idx // 8, mask=valid, other=0).to(tl.int32)
    bit = (byte >> (7 - idx % 8)) & 1
    step = tl.load(scale_ptr + idx // group, mask=valid, other=0.0) * alpha
    w = tl.load(w_ptr + idx, mask=valid, other=0.0).to(tl.float32)
    w = w + tl.where(bit != 0, step, -step)
    if BF16:
        raw = w.to(tl.uint32, bitcast=True)
        raw = (raw + 0x7FFF + ((raw >> 16) & 1)) >> 16
        tl.store(w_ptr + idx, raw.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=valid)
    else:
        tl.store(w_ptr + idx, w.to(w_ptr.dtype.element_ty), mask=valid)


def pack(x: Tensor, bits: Tensor, scales: Tensor, group: int) -> None:
    """Fill `bits` (ceil(n/8),) uint8 and `scales` (ceil(n/group),) float32 from `x` (n,) float32.

    Each scale is the float32 sum of |x| over the group, added in the order of PyTorch's CPU
    sum of a contiguous float32 row (`cascade_sum` with 8-lane vectors, the order of x86
    builds), divided by the group's length with IEEE rounding: the same bits as
    `zoo_gym.compression.bitdelta.pack` on such a CPU. A partial last group is summed as if
    padded with zeros, as the CPU path pads it.
    """
    n = x.numel()
    if n == 0:
        return
    groups = scales.numel()
    rows = min(_PACK_ROWS, triton.next_power_of_2(groups))
    grid = (triton.cdiv(groups, rows),)
    _pack_kernel[grid](x, bits, scales, n, groups, GROUP=group, ROWS=rows)


def unpack(
    bits: Tensor, scales: Tensor, out: Tensor, group: int, weight: float, accumulate: bool
) -> None:
    """``out (+)= weight * decode(bits, scales)`` for `out` (n,) float32."""
    n = out.numel()
    if n == 0:
        return
    grid = (triton.cdiv(n, _BLOCK),)
    _unpack_kernel[grid](
        bits, scales, out, n, group, weight, ACCUMULATE=accumulate, BLOCK=_BLOCK, **_EXACT
    )


def apply_(weights: Tensor, bits: Tensor, scales: Tensor, group: int, alpha: float) -> None:
    """``weights += alpha * decode(bits, scales)`` in place, weights contiguous fp32/fp16/bf16."""
    n = weights.numel()
    if n == 0:
        return
    bf16 = weights.dtype == torch.bfloat16
    grid = (triton.cdiv(n, _BLOCK),)
    _apply_kernel[grid](weights, bits, scales, n, group, alpha, BF16=bf16, BLOCK=_BLOCK, **_EXACT)
