"""The 1-bit product of BitDelta variants with a batch's rows, without merged weights.

A BitDelta variant [Liu et al., 2024] stores a weight's delta to its base as one sign bit per
value and one scale per group of `group` consecutive values of the row-major flattened
(out, in) matrix: ``D[o, i] = scale[(o * in + i) // group] * sign(o, i)``. For the rows x
(n, in) that use the variant, a layer adds ``x @ D^T`` to the base's ``x @ W^T``:

    (x @ D^T)[r, o] = sum_g scale[g] * sum_{i in g} sign(o, i) * x[r, i]

`accumulate` adds it for several variants at once to the rows of a layer's output (each
variant's rows listed in one index), `product` returns it (rows grouped by variant):

- on CUDA tensors, the Triton kernels (`zoo_gym.serving.kernels`): one launch per layer for
  all the variants of a batch, the products added into the output's rows in place; a decode
  step's one row per variant by a GEMV that reads 32-bit words of signs (adding each row's
  bias delta in the same pass), several rows by a binary GEMM whose tiles of signs are
  decoded in registers and multiplied on the tensor cores;
- on the CPU, the compiled kernel (`zoo_gym/serving/_binary_gemm.c`, built where a C compiler
  was present) for ``in % 8 == 0`` and ``group % 8 == 0``, reading the packed bits directly and
  adding into the output's rows in place: with AVX-512, 16 outputs at once by nibble tables
  (one permute per 64 weights) where rows hold whole groups of a multiple of 32 weights, and
  ``2 * (sum of x over set bits) - (sum of x)`` per group by masked adds (one per 16 weights)
  for the others; byte tables (one lookup per 8 weights) elsewhere. The nibble kernel reads
  16 rows at once from bits interleaved by 4 bytes when the variant was loaded
  (`kernel_layout`); its threads are torch's OpenMP team. `operands` prepares a layer's
  variants for it once (per batch), so that a call hands over prepared lists;
- otherwise `product_reference`, the torch reference: each variant's delta is decoded into one
  reused float32 buffer and multiplied (correct for every shape, slow).

`add_rows` adds an embedding's looked-up delta rows the same three ways: one Triton launch,
one call of the compiled kernel, or torch per variant.

Bit layout as `zoo_gym.compression.bitdelta`: value ``8i + j`` is bit ``7 - j`` of byte ``i``,
1 for a positive sign.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from zoo_gym.compression import kernels
from zoo_gym.core.extension import Extension
from zoo_gym.serving.packed import PackedTensor, alike

if TYPE_CHECKING:
    from zoo_gym.serving.kernels import Table

_COMPILED = Extension("zoo_gym.serving._binary_gemm")
# weights x rows below which the CPU kernel runs on one thread: a second thread cost more than
# it saved on a 128 x 896 layer of 100 variants (0.44 ms against 0.32 ms on one)
SMALL = 1 << 24
SCALE_KINDS = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}  # as `_binary_gemm` reads


def compiled_available() -> bool:
    """Whether the compiled CPU kernel (`zoo_gym/serving/_binary_gemm.c`) was built and imports."""
    return _COMPILED.available


def use_compiled(enabled: bool) -> bool:
    """Run CPU products through the compiled kernel when `enabled` (and built), through
    `product_reference` otherwise. Returns the previous setting."""
    return _COMPILED.use(enabled)


def product_reference(x: Tensor, weights: Sequence[PackedTensor], starts: Sequence[int]) -> Tensor:
    """``x[starts[k]:starts[k+1]] @ D_k^T`` for every variant k, as (R, out) float32: each
    delta decoded into one reused float32 buffer (the reference of the kernels)."""
    out_features, in_features = weights[0].shape if weights else (0, x.shape[1])
    out = torch.zeros(x.shape[0], out_features, device=x.device)
    buffer = torch.empty(out_features * in_features, device=x.device)
    for k, packed in enumerate(weights):
        rows = slice(starts[k], starts[k + 1])
        torch.matmul(x[rows], packed.decode(buffer).T, out=out[rows])
    return out


def compiled_for(packed: PackedTensor, device: torch.device) -> bool:
    """Whether `product` runs the compiled kernel for a (out, in) weight on `device`."""
    in_features = packed.shape[-1]
    return (
        _COMPILED.enabled
        and device.type == "cpu"
        and len(packed.shape) == 2
        and in_features % 8 == 0
        and packed.group % 8 == 0
        and packed.scales.dtype in SCALE_KINDS
    )


def reads_lanes(packed: PackedTensor) -> bool:
    """Whether the compiled kernel reads `packed` 16 rows at a time from bits interleaved
    by `PackedTensor.interleaved`: built with its AVX-512 kernel, for a CPU weight whose rows
    hold whole groups of a multiple of 32 weights. Read so, it skips transposing 64 bytes of
    each of 16 rows: a C copy of its loop on one thread read 5.0 GB/s of signs from memory
    transposing and 5.8 with them interleaved (a 151936 x 896 layer)."""
    module = _COMPILED.module if _COMPILED.available else None
    return (
        module is not None
        and module.kernel == "avx512"
        and packed.bits.device.type == "cpu"
        and len(packed.shape) == 2
        and packed.shape[1] % packed.group == 0
        and packed.group % 32 == 0
        and packed.scales.dtype in SCALE_KINDS
    )


def kernel_layout(packed: PackedTensor) -> PackedTensor:
    """`packed` as the kernel of its device reads it fastest: interleaved where
    `reads_lanes`, as it is elsewhere."""
    return packed.interleaved() if reads_lanes(packed) else packed


@dataclass(frozen=True)
class Operands:
    """One layer's weights of several variants (each (out, in)), and, where the compiled
    kernel takes them all (CPU, one group size and scale dtype), their signs and scales as
    the arrays it reads: made once by `operands`, handed over by every `accumulate`."""

    weights: tuple[PackedTensor, ...]
    bits: list[Any]  # numpy uint8 (out * in / 8,) per variant; empty where not compiled
    scales: list[Any]  # numpy int16 (float16 or bfloat16 bits) or float32 (G,) per variant
    kind: int  # SCALE_KINDS of the scales; -1 where the compiled kernel does not take them
    addresses: Table | None = None  # on CUDA, where one launch takes them: the kernel's table


def operands(weights: Sequence[PackedTensor]) -> Operands:
    """`weights` (one per variant, the same shape) prepared for `accumulate`."""
    ready = tuple(weights)
    if not ready:
        return Operands(ready, [], [], -1)
    first, same = ready[0], alike(ready)
    if first.bits.is_cuda and kernels.available():
        from zoo_gym.serving import kernels as triton_kernels

        return Operands(ready, [], [], -1, triton_kernels.table(ready) if same else None)
    readable = not first.lanes or reads_lanes(first)  # interleaved bits it can read so
    if not (same and readable and compiled_for(first, first.bits.device)):
        return Operands(ready, [], [], -1)
    kind = SCALE_KINDS[first.scales.dtype]
    scales = [w.scales.view(torch.int16) if kind < 2 else w.scales for w in ready]
    return Operands(ready, [w.bits.numpy() for w in ready], [s.numpy() for s in scales], kind)


def _compiled_takes(out: Tensor, x: Tensor, prepared: Operands) -> bool:
    """Whether the compiled kernel adds `prepared`'s products into `out` in place."""
    return (
        prepared.kind >= 0
        and _COMPILED.enabled
        and out.dtype == torch.float32
        and out.is_contiguous()
        and out.device.type == "cpu"
        and x.device.type == "cpu"
    )


def _threads(rows: int, packed: PackedTensor, threads: int) -> int:
    return threads or (1 if rows * packed.numel < SMALL else torch.get_num_threads())


def accumulate(
    out: Tensor,
    x: Tensor,
    rows: Tensor,
    prepared: Operands,
    starts: Sequence[int],
    *,
    threads: int = 0,
    bias: Tensor | None = None,
) -> bool:
    """``out[rows[j]] += x[rows[j]] @ D_k^T`` for the entries j in starts[k] .. starts[k + 1]
    of `rows` (R,) int64 and each variant k of `prepared`: x (X, in), out (X, out). On CUDA the
    Triton kernel adds in place (any float dtype); on the CPU the compiled kernel does where out
    is float32 and contiguous; elsewhere `product` runs on the picked rows and `index_add_` adds
    them. `threads` as for `product`. Returns whether `bias` (B, out), a bias delta per batch
    row, was added too, in the same pass (see `kernels.accumulate`); the caller adds it where
    not."""
    if not prepared.weights or len(rows) == 0:
        return False
    first = prepared.weights[0]
    if on_gpu(out):
        from zoo_gym.serving import kernels as triton_kernels

        return triton_kernels.accumulate(
            out, x, rows, prepared.weights, starts, prepared.addresses, bias
        )
    if _compiled_takes(out, x, prepared):
        assert _COMPILED.module is not None
        _COMPILED.module.accumulate(
            x.float().contiguous().numpy(),
            out.numpy(),
            rows.to(torch.int64).contiguous().numpy(),
            list(starts),
            prepared.bits,
            prepared.scales,
            first.shape[1],
            first.group,
            prepared.kind,
            _threads(len(rows), first, threads),
            first.lanes,
        )
        return False
    picked = x.index_select(0, rows).float()
    delta = product(picked, prepared.weights, starts, threads=threads)
    out.index_add_(0, rows, delta.to(out.dtype))
    return False


def on_gpu(out: Tensor) -> bool:
    """Whether the Triton kernels run for an output on `out`'s device (CUDA with Triton)."""
    return out.is_cuda and kernels.available()


def add_rows(
    out: Tensor, ids: Tensor, rows: Tensor, prepared: Operands, starts: Sequence[int]
) -> None:
    """``out[rows[j]] += D_k[ids[rows[j]]]`` for the entries j in starts[k] .. starts[k + 1]
    of `rows` and each variant k of `prepared` (an embedding's (V, cols) weights), out
    (X, cols) and ids (X,): the rows each position looks up. On CUDA every variant in one
    Triton launch; on the CPU one call of the compiled kernel where out is float32 and
    contiguous; elsewhere each variant's rows decoded by torch (`PackedTensor.decode_rows`)."""
    if not prepared.weights or len(rows) == 0:
        return
    if on_gpu(out):
        from zoo_gym.serving import kernels as triton_kernels

        triton_kernels.add_rows(out, ids, rows, prepared.weights, starts, prepared.addresses)
        return
    first = prepared.weights[0]
    if _compiled_takes(out, out, prepared):
        assert _COMPILED.module is not None
        _COMPILED.module.add_rows(
            out.numpy(),
            ids.to(torch.int64).contiguous().numpy(),
            rows.to(torch.int64).contiguous().numpy(),
            list(starts),
            prepared.bits,
            prepared.scales,
            *(first.shape[0], first.shape[1], first.group, prepared.kind, first.lanes),
        )
        return
    for k, packed in enumerate(prepared.weights):
        mine = rows[starts[k] : starts[k + 1]]
        delta = packed.decode_rows(ids.index_select(0, mine))
        out.index_add_(0, mine, delta.to(out.dtype))


def product(
    x: Tensor, weights: Sequence[PackedTensor], starts: Sequence[int], *, threads: int = 0
) -> Tensor:
    """The 1-bit products of the variants' deltas `weights` (each (out, in), one group size and
    scale dtype) with the rows of `x` (R, in) float32 grouped by variant (variant k owns rows
    starts[k] .. starts[k + 1]) -> (R, out) float32. `threads` (CPU kernel): 0 for
    `torch.get_num_threads()`, or 1 for less than `SMALL` weights x rows, where starting a
    thread costs more than it saves."""
    if not weights:
        return torch.zeros(x.shape[0], 0, device=x.device)
    if x.is_cuda and kernels.available():
        from zoo_gym.serving import kernels as triton_kernels

        return triton_kernels.product(x, weights, starts)
    prepared = operands(weights)
    if prepared.kind < 0 or x.device.type != "cpu":
        return product_reference(x, weights, starts)
    out = torch.zeros(x.shape[0], weights[0].shape[0])
    accumulate(out, x, torch.arange(x.shape[0]), prepared, starts, threads=threads)
    return out
