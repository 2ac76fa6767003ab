"""A Triton binary GEMM for the 1-bit products of BitDelta variants (the GPU path).

For each variant k with rows x_k (M_k, K) and a delta D_k (N, K) stored as packed signs and group
scales, ``out[rows_k] += x[rows_k] @ D_k^T``: one launch per layer for every variant of a batch
(a grid of variants x blocks of outputs x up to `MAX_SPLIT` programs sharing a variant's blocks of
rows, the positions of a prompt; each program finds its variant's signs and scales through a
table of addresses), so a decode step of 100 distinct variants costs one launch per linear layer,
not one per variant, and a long prompt of one variant still fills the GPU. As in BitDelta [Liu et al., 2024], the signs are never materialised in memory:
each program decodes a (BLOCK_N, BLOCK_K) tile of signs from the packed bytes in registers.

- Where every row holds whole groups and a block of inputs lies in one group (``K % group == 0``
  and ``group % BLOCK_K == 0``: Qwen2.5's and Llama's layers with BitDelta's groups of 128), the
  tile is +-1 in x's dtype: ``tl.dot`` of x with the signs is exact per product (bfloat16 and
  float16 on the tensor cores, float32 in IEEE arithmetic), accumulated in float32 and then scaled
  by the block's group scales, the reference's ``sum_g scale_g * sum_{i in g} sign * x``.
- Elsewhere (groups that start mid-row) each weight is ``where(bit, scale, -scale)`` and the dot
  runs in float32 (IEEE, no TF32).
- A decode step gives each variant a row (at most `GEMV_ROWS`): there, where rows hold
  whole groups, `_gemv_kernel` runs instead, one program per row and block of outputs, a
  thread per output reading its signs as 32-bit words, each bit flipping the sign of +-x_i by
  one xor (three instructions a weight as compiled for sm_90), summed per group in float32 and
  scaled, with no 16-row tile of which one row is real. On an H200 with 100 variants of one
  row it read signs at 400 to 700 GB/s against the tiled dot's 130 to 157 (`bench/README.md`).

Products are added into the output in place (float32 sums, rounded once to the output's dtype);
each row of the output belongs to one variant. Bit layout and groups as `zoo_gym.serving.binary`
(the torch reference this is tested against: value f of the flattened (N, K) delta is bit
7 - f % 8 of byte f // 8, scale f // group). Runs on CUDA tensors, and on CPU tensors under
``TRITON_INTERPRET=1`` (tests).
"""

# mypy: disable-error-code="untyped-decorator,no-untyped-def"

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from zoo_gym.serving.packed import PackedTensor, alike

BLOCK_M = 16  # rows of x per step (tl.dot needs 16 or more)
BLOCK_N = 64  # outputs per program
WIDE_K = 128  # inputs per step where a step lies in one group
NARROW_K = 32  # inputs per step elsewhere
ROWS_BLOCK = 256  # values of an embedding row per program
MAX_SPLIT = 128  # programs that share one variant's rows (a prompt's positions) per block
# at most this many rows per variant (a decode step's one token each) take `_gemv_kernel`;
# 0 sends every product through `_accumulate_kernel`. The GEMV decodes a variant's signs
# once per row, the tiled dot once per 16 rows: on an H200, 100 variants of a 4864 x 896
# layer took 0.34 ms with two rows each in the GEMV against 0.36 in the tiled dot, and 0.68
# against 0.37 with four
GEMV_ROWS = 2
# (outputs per program, warps) of `_gemv_kernel`: up to `GEMV_FEW` outputs, one warp of 128
# (more programs to fill the GPU), else four warps of 256. On an H200 with 100 variants of one
# row: 896 x 896 0.028 ms against 0.034, 896 x 4864 0.136 against 0.153; 4864 x 896 0.125
# against 0.106, and the LM head (151936 x 896) 4.30 against 2.45
GEMV_FEW = 1024
GEMV_SHAPES = ((128, 1), (256, 4))


@triton.jit
def _signs(bits_ptr, rn, k0, K, n_mask, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The (BLOCK_N, BLOCK_K) tile of signs (+1 / -1, int32) of rows rn, inputs k0 ..: one load
    of BLOCK_K / 8 bytes per row, each byte's 8 bits shifted out in registers."""
    rb = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    at = rn[:, None].to(tl.int64) * (K // 8) + rb[None, :]
    byte = tl.load(bits_ptr + at, mask=n_mask[:, None], other=0).to(tl.int32)
    shift = 7 - tl.arange(0, 8)
    bit = (byte[:, :, None] >> shift[None, None, :]) & 1
    return tl.reshape(bit * 2 - 1, (BLOCK_N, BLOCK_K))


@triton.jit
def _values(bits_ptr, scale_ptr, flat, group, mask):
    """The delta's values at the flat indices `flat` (any shape), float32: +-scale by bit."""
    byte = tl.load(bits_ptr + flat // 8, mask=mask, other=0).to(tl.int32)
    bit = (byte >> (7 - (flat % 8)).to(tl.int32)) & 1
    scale = tl.load(scale_ptr + flat // group, mask=mask, other=0.0).to(tl.float32)
    return tl.where(bit != 0, scale, -scale)


@triton.jit
def _weights(bits_ptr, scale_ptr, rn, rk, K, group, n_mask, k_mask):
    """The (BLOCK_N, BLOCK_K) tile of scaled weights, float32, for any group layout."""
    flat = rn[:, None].to(tl.int64) * K + rk[None, :]
    return _values(bits_ptr, scale_ptr, flat, group, n_mask[:, None] & k_mask[None, :])


@triton.jit
def _accumulate_kernel(
    x_ptr,
    out_ptr,
    rows_ptr,
    starts_ptr,
    bits_table,
    scales_table,
    scale_like,
    N,
    K,
    group,
    stride_x,
    stride_out,
    ROW_GROUPS: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    v = tl.program_id(0)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    r0 = tl.load(starts_ptr + v)
    r1 = tl.load(starts_ptr + v + 1)
    bits_ptr = tl.load(bits_table + v).to(tl.pointer_type(tl.uint8))
    scale_ptr = tl.load(scales_table + v).to(tl.pointer_type(scale_like.dtype.element_ty))
    for m0 in range(r0 + tl.program_id(2) * BLOCK_M, r1, BLOCK_M * tl.num_programs(2)):
        jm = m0 + tl.arange(0, BLOCK_M)
        m_mask = jm < r1
        rid = tl.load(rows_ptr + jm, mask=m_mask, other=0).to(tl.int64)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            k_mask = rk < K
            x_at = x_ptr + rid[:, None] * stride_x + rk[None, :]
            x = tl.load(x_at, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            if ROW_GROUPS:
                sign = _signs(bits_ptr, rn, k0, K, n_mask, BLOCK_N, BLOCK_K).to(x.dtype)
                if IEEE:
                    part = tl.dot(x, tl.trans(sign), input_precision="ieee")
                else:
                    part = tl.dot(x, tl.trans(sign))
                g = (rn.to(tl.int64) * K + k0) // group
                scale = tl.load(scale_ptr + g, mask=n_mask, other=0.0).to(tl.float32)
                acc += part * scale[None, :]
            else:
                w = _weights(bits_ptr, scale_ptr, rn, rk, K, group, n_mask, k_mask)
                acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
        o_at = out_ptr + rid[:, None] * stride_out + rn[None, :]
        o_mask = m_mask[:, None] & n_mask[None, :]
        current = tl.load(o_at, mask=o_mask, other=0.0).to(tl.float32)
        tl.store(o_at, (current + acc).to(out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit
def _gemv_kernel(
    x_ptr,
    out_ptr,
    rows_ptr,
    starts_ptr,
    bits_table,
    scales_table,
    scale_like,
    N,
    group,
    stride_x,
    stride_out,
    bias_ptr,
    per_row,
    ROW_WORDS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    STEP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    """Rows of variants whose weights' rows are whole groups of a multiple of 32 * STEP inputs
    (signs aligned as `Table.aligned` checks): each program takes one row of its variant and BLOCK_N outputs, a
    thread its outputs' 32-bit words of signs. Input i of a word is the word's bit
    8 * (i // 8) + 7 - i % 8 (bytes in memory order, each from its top bit); shifted to the
    top, that bit turns -x_i into +x_i by one xor of the float's sign, so each weight costs a
    shift, a mask-and-xor and an add, with no layout of bits across threads. Sums are float32
    per step of 32 * STEP inputs (inside one group), then scaled. With HAS_BIAS, row r also
    gets row r // per_row of the (B, N) `bias_ptr` (a bias delta per batch row) in the same
    pass."""
    v = tl.program_id(0)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    first = tl.load(starts_ptr + v)
    stop = tl.load(starts_ptr + v + 1)
    words_ptr = tl.load(bits_table + v).to(tl.pointer_type(tl.uint32))
    scale_ptr = tl.load(scales_table + v).to(tl.pointer_type(scale_like.dtype.element_ty))
    row_at = rn.to(tl.int64) * ROW_WORDS
    row_group = rn.to(tl.int64) * (ROW_WORDS * 32 // group)  # each row's first group
    for j in range(first + tl.program_id(2), stop, tl.num_programs(2)):
        rid = tl.load(rows_ptr + j).to(tl.int64)
        x_row = x_ptr + rid * stride_x
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        if HAS_BIAS:
            acc = tl.load(bias_ptr + rid // per_row * N + rn, mask=n_mask, other=0.0)
            acc = acc.to(tl.float32)
        for s in range(0, ROW_WORDS, STEP):
            part = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for w in tl.static_range(STEP):
                word = tl.load(words_ptr + row_at + s + w, mask=n_mask, other=0)
                for i in tl.static_range(32):
                    x = tl.load(x_row + (s + w) * 32 + i).to(tl.float32)
                    top = (word << (31 - (i // 8 * 8 + 7 - i % 8))) & 0x80000000
                    signed = x.to(tl.uint32, bitcast=True) ^ top ^ 0x80000000
                    part += signed.to(tl.float32, bitcast=True)
            scale = tl.load(scale_ptr + row_group + s * 32 // group, mask=n_mask, other=0.0)
            acc += part * scale.to(tl.float32)
        at_out = out_ptr + rid * stride_out + rn
        current = tl.load(at_out, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(at_out, (current + acc).to(out_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _rows_kernel(
    out_ptr,
    ids_ptr,
    rows_ptr,
    starts_ptr,
    bits_table,
    scales_table,
    scale_like,
    cols,
    group,
    stride_out,
    BLOCK: tl.constexpr,
):
    v = tl.program_id(0)
    rc = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    c_mask = rc < cols
    bits_ptr = tl.load(bits_table + v).to(tl.pointer_type(tl.uint8))
    scale_ptr = tl.load(scales_table + v).to(tl.pointer_type(scale_like.dtype.element_ty))
    first, stop = tl.load(starts_ptr + v), tl.load(starts_ptr + v + 1)
    for j in range(first + tl.program_id(2), stop, tl.num_programs(2)):
        row = tl.load(rows_ptr + j).to(tl.int64)
        flat = tl.load(ids_ptr + row).to(tl.int64) * cols + rc
        value = _values(bits_ptr, scale_ptr, flat, group, c_mask)
        at = out_ptr + row * stride_out + rc
        current = tl.load(at, mask=c_mask, other=0.0).to(tl.float32)
        tl.store(at, (current + value).to(out_ptr.dtype.element_ty), mask=c_mask)


def add_rows(
    out: Tensor,
    ids: Tensor,
    rows: Tensor,
    weights: Sequence[PackedTensor],
    starts: Sequence[int],
    addresses: Table | None = None,
) -> None:
    """``out[rows[j]] += D_k[ids[rows[j]]]`` for the entries j in starts[k] .. starts[k + 1]
    of `rows` and each variant k of `weights` (each (V, cols), one group size and scale dtype,
    on `out`'s device): an embedding's looked-up rows of every variant in one launch. `ids`
    (X,) integer, out (X, cols) of unit stride along a row, any float dtype."""
    if not weights or len(rows) == 0:
        return
    first = weights[0]
    if addresses is None and not alike(weights):
        for k, packed in enumerate(weights):  # one launch needs one group size and scale dtype
            mine = rows[starts[k] : starts[k + 1]]
            add_rows(out, ids, mine, [packed], [0, len(mine)])
        return
    if out.stride(-1) != 1:
        raise ValueError("add_rows adds in place into rows of unit stride; pass a contiguous out")
    cols = first.shape[1]
    addresses = table(weights) if addresses is None else addresses
    bounds, most = _bounds(tuple(starts), out.device)
    grid = (len(weights), triton.cdiv(cols, ROWS_BLOCK), min(most, MAX_SPLIT))
    _rows_kernel[grid](
        out,
        ids,
        rows,
        bounds,
        addresses.bits,
        addresses.scales,
        first.scales,
        cols,
        first.group,
        out.stride(0),
        BLOCK=ROWS_BLOCK,
    )


@functools.lru_cache(maxsize=256)
def _bounds(starts: tuple[int, ...], device: torch.device) -> tuple[Tensor, int]:
    """`starts` as an int64 tensor on `device`, made once (a copy to the GPU on every call
    would wait for the queue of kernels ahead of it), and the most rows a variant has."""
    most = max(b - a for a, b in itertools.pairwise(starts))
    return torch.tensor(starts, dtype=torch.int64, device=device), most


@dataclass(frozen=True)
class Table:
    """Where a batch's variants of one layer keep their signs and scales, as the kernels read
    them: (V,) int64 addresses on the weights' device (the weights must stay alive while it is
    used), and whether every variant's signs start on a 16-byte boundary (`_gemv_kernel` reads
    them as 32-bit words)."""

    bits: Tensor
    scales: Tensor
    aligned: bool


def table(weights: Sequence[PackedTensor]) -> Table:
    """The `Table` of `weights`, made once per batch and handed to every `accumulate`."""
    device = weights[0].bits.device
    bits = [w.bits.data_ptr() for w in weights]
    scales = [w.scales.data_ptr() for w in weights]
    return Table(
        torch.tensor(bits, dtype=torch.int64, device=device),
        torch.tensor(scales, dtype=torch.int64, device=device),
        all(address % 16 == 0 for address in bits),
    )


def accumulate(
    out: Tensor,
    x: Tensor,
    rows: Tensor,
    weights: Sequence[PackedTensor],
    starts: Sequence[int],
    addresses: Table | None = None,
    bias: Tensor | None = None,
) -> bool:
    """``out[rows[j]] += x[rows[j]] @ D_k^T`` for the entries j in starts[k] .. starts[k + 1]
    of `rows` (R,) and each variant k of `weights` (each (out, in), on `x`'s device), in one
    launch where they share one group size and scale dtype (else one per variant): x (X, in)
    and out (X, out, unit stride along a row) of any float dtype. `addresses` is
    `table(weights)` where the caller keeps it (and has checked that they are `alike`).

    `bias` (B, out), contiguous, a bias delta per batch row where `out` holds B * P rows: the
    GEMV adds row r // P of it to each row r of `rows` in the same pass, and this returns
    True; elsewhere it is not added, and this returns False."""
    if not weights or len(rows) == 0:
        return False
    first = weights[0]
    if addresses is None and not alike(weights):
        for k, packed in enumerate(weights):  # one launch needs one group size and scale dtype
            accumulate(
                out, x, rows[starts[k] : starts[k + 1]], [packed], [0, starts[k + 1] - starts[k]]
            )
        return False
    in_features = first.shape[1]
    if out.stride(-1) != 1:
        raise ValueError("accumulate adds in place into rows of unit stride; pass a contiguous out")
    x = x if x.stride(-1) == 1 else x.contiguous()
    if not x.is_cuda:  # the interpreter multiplies 16-bit tiles as integers: float32 there
        x = x.float()
    row_groups = in_features % first.group == 0 and first.group % WIDE_K == 0
    addresses = table(weights) if addresses is None else addresses
    bounds, most = _bounds(tuple(starts), x.device)
    if row_groups and most <= GEMV_ROWS and addresses.aligned:
        _gemv(out, x, rows, first, addresses, bounds, most, bias)
        return bias is not None
    _tiled(out, x, rows, first, addresses, bounds, most, row_groups)
    return False


def _tiled(
    out: Tensor,
    x: Tensor,
    rows: Tensor,
    first: PackedTensor,
    addresses: Table,
    bounds: Tensor,
    most: int,
    row_groups: bool,
) -> None:
    """`accumulate` through `_accumulate_kernel`: a program per variant, block of outputs and
    share of the variant's blocks of rows."""
    out_features, in_features = first.shape
    split = min(triton.cdiv(most, BLOCK_M), MAX_SPLIT)
    _accumulate_kernel[(len(bounds) - 1, triton.cdiv(out_features, BLOCK_N), split)](
        *(x, out, rows.to(torch.int64), bounds, addresses.bits, addresses.scales, first.scales),
        *(out_features, in_features, first.group, x.stride(0), out.stride(0)),
        ROW_GROUPS=row_groups,
        IEEE=x.dtype == torch.float32,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=WIDE_K if row_groups else NARROW_K,
    )


def _gemv(
    out: Tensor,
    x: Tensor,
    rows: Tensor,
    first: PackedTensor,
    addresses: Table,
    bounds: Tensor,
    most: int,
    bias: Tensor | None,
) -> None:
    """`accumulate` through `_gemv_kernel`: a program per variant, block of outputs and row."""
    out_features, in_features = first.shape
    block, warps = GEMV_SHAPES[out_features > GEMV_FEW]
    grid = (len(bounds) - 1, triton.cdiv(out_features, block), most)
    per_row = 1 if bias is None else out.shape[0] // bias.shape[0]
    _gemv_kernel[grid](
        *(x, out, rows.to(torch.int64), bounds, addresses.bits, addresses.scales, first.scales),
        *(out_features, first.group, x.stride(0), out.stride(0), out if bias is None else bias),
        per_row,
        ROW_WORDS=in_features // 32,
        BLOCK_N=block,
        STEP=WIDE_K // 32,
        HAS_BIAS=bias is not None,
        num_warps=warps,
    )


def product(x: Tensor, weights: Sequence[PackedTensor], starts: Sequence[int]) -> Tensor:
    """``x[starts[k]:starts[k+1]] @ D_k^T`` for every variant k -> (R, out) float32, on
    `x`'s device; `x` (R, in) is float32 or bfloat16, each `weights[k]` an (out, in) delta
    whose signs and scales live on that device."""
    out_features = weights[0].shape[0]
    x = x.contiguous()
    out = torch.zeros(x.shape[0], out_features, dtype=torch.float32, device=x.device)
    accumulate(out, x, torch.arange(x.shape[0], device=x.device), weights, starts)
    return out
