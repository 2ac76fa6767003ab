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


@triton.jit
def _pack_kernel(x_ptr, bits_ptr, scale_ptr, n, GROUP: tl.constexpr, BLOCK: tl.constexpr):
    # One program per group of GROUP values (GROUP % 8 == 0, BLOCK = next power of two).
    pid = tl.program_id(0)
    local = tl.arange(0, BLOCK)
    idx = pid * GROUP + local
    valid = (local < GROUP) & (idx < n)
    x = tl.load(x_ptr + idx, mask=valid, other=0.0)
    count = tl.minimum(n - pid * GROUP, GROUP).to(tl.float32)
    tl.store(scale_ptr + pid, tl.sum(tl.abs(x), axis=0) / count)
    bits = ((x >= 0) & valid).to(tl.int32)
    weights = 1 << (7 - tl.arange(0, 8))
    packed = tl.sum(tl.reshape(bits, (BLOCK // 8, 8)) * weights[None, :], axis=1)
    byte = tl.arange(0, BLOCK // 8)
    out = pid * (GROUP // 8) + byte
    tl.store(bits_ptr + out, packed.to(tl.uint8), mask=(byte < GROUP // 8) & (out < (n + 7) // 8))


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
    """Fill `bits` (ceil(n/8),) uint8 and `scales` (ceil(n/group),) float32 from `x` (n,) float32."""
    n = x.numel()
    if n == 0:
        return
    block = max(8, triton.next_power_of_2(group))
    _pack_kernel[(scales.numel(),)](x, bits, scales, n, GROUP=group, BLOCK=block)


def unpack(
    bits: Tensor, scales: Tensor, out: Tensor, group: int, weight: float, accumulate: bool
) -> None:
    """``out (+)= weight * decode(bits, scales)`` for `out` (n,) float32."""
    n = out.numel()
    if n == 0:
        return
    grid = (triton.cdiv(n, _BLOCK),)
    _unpack_kernel[grid](bits, scales, out, n, group, weight, ACCUMULATE=accumulate, BLOCK=_BLOCK)


def apply_(weights: Tensor, bits: Tensor, scales: Tensor, group: int, alpha: float) -> None:
    """``weights += alpha * decode(bits, scales)`` in place, weights contiguous fp32/fp16/bf16."""
    n = weights.numel()
    if n == 0:
        return
    bf16 = weights.dtype == torch.bfloat16
    grid = (triton.cdiv(n, _BLOCK),)
    _apply_kernel[grid](weights, bits, scales, n, group, alpha, BF16=bf16, BLOCK=_BLOCK)
