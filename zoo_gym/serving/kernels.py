"""A Triton binary GEMM for the 1-bit product of BitDelta variants (the GPU path).

For each variant k with rows x_k (M, K) and a delta D_k (N, K) stored as packed signs and group
scales, ``out_k = x_k @ D_k^T``. As in BitDelta [Liu et al., 2024], the signs are never
materialised in memory: each program decodes a (BLOCK_N, BLOCK_K) tile of D from the packed
bytes and the scales in registers (``where(bit, scale, -scale)``) and multiplies it with the
(BLOCK_M, BLOCK_K) tile of x with `tl.dot` in float32 (IEEE, no TF32). Bits are read once
per tile of rows, so a batch reads each variant's 1.125 bits per weight instead of a merged
copy's 16.

Bit layout and groups as `zoo_gym.serving.binary` (the torch reference this is tested
against: value f of the flattened (N, K) delta is bit 7 - f % 8 of byte f // 8, scale
f // group). Runs on CUDA tensors, and on CPU tensors under ``TRITON_INTERPRET=1`` (tests).
"""

# mypy: disable-error-code="untyped-decorator,no-untyped-def"

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from zoo_gym.serving.packed import PackedTensor

BLOCK_M = 16  # rows of x per program (tl.dot needs 16 or more)
BLOCK_N = 32  # outputs per program
BLOCK_K = 32  # inputs per step


@triton.jit
def _binary_gemm_kernel(
    x_ptr,
    bits_ptr,
    scale_ptr,
    out_ptr,
    M,
    N,
    K,
    group,
    stride_xm,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x_mask = (rm[:, None] < M) & (rk[None, :] < K)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=x_mask, other=0.0)
        flat = rn[:, None].to(tl.int64) * K + rk[None, :]  # (BLOCK_N, BLOCK_K)
        w_mask = (rn[:, None] < N) & (rk[None, :] < K)
        byte = tl.load(bits_ptr + flat // 8, mask=w_mask, other=0).to(tl.int32)
        bit = (byte >> (7 - (flat % 8)).to(tl.int32)) & 1
        scale = tl.load(scale_ptr + flat // group, mask=w_mask, other=0.0).to(tl.float32)
        w = tl.where(bit != 0, scale, -scale)
        acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
    out_mask = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc, mask=out_mask)


def product(x: Tensor, weights: Sequence[PackedTensor], starts: Sequence[int]) -> Tensor:
    """``x[starts[k]:starts[k+1]] @ D_k^T`` for every variant k -> (R, out) float32, on
    `x`'s device; `x` (R, in) is float32 or bfloat16, each `weights[k]` an (out, in) delta
    whose signs and scales live on that device."""
    out_features, in_features = weights[0].shape
    x = x.contiguous()
    out = torch.zeros(x.shape[0], out_features, dtype=torch.float32, device=x.device)
    for k, packed in enumerate(weights):
        rows = starts[k + 1] - starts[k]
        if rows == 0:
            continue
        grid = (triton.cdiv(rows, BLOCK_M), triton.cdiv(out_features, BLOCK_N))
        _binary_gemm_kernel[grid](
            x[starts[k] :],
            packed.bits,
            packed.scales,
            out[starts[k] :],
            rows,
            out_features,
            in_features,
            packed.group,
            x.stride(0),
            out.stride(0),
            BLOCK_M=BLOCK_M,
            BLOCK_N=BLOCK_N,
            BLOCK_K=BLOCK_K,
        )
    return out
