"""The 1-bit product of BitDelta variants with a batch's rows, without merged weights.

A BitDelta variant [Liu et al., 2024] stores a weight's delta to its base as one sign bit per
value and one scale per group of `group` consecutive values of the row-major flattened
(out, in) matrix: ``D[o, i] = scale[(o * in + i) // group] * sign(o, i)``. For the rows x
(n, in) that use the variant, a layer adds ``x @ D^T`` to the base's ``x @ W^T``:

    (x @ D^T)[r, o] = sum_g scale[g] * sum_{i in g} sign(o, i) * x[r, i]

`product` computes it for several variants at once (rows grouped by variant):

- on CUDA tensors, the Triton binary GEMM (`zoo_gym.serving.kernels`), which decodes each tile
  of signs in registers and multiplies it on the tensor cores;
- on the CPU, the compiled kernel (`zoo_gym/serving/_binary_gemm.c`, built where a C compiler
  was present) for ``in % 8 == 0`` and ``group % 8 == 0``: each output is
  ``2 * (sum of x over set bits) - (sum of x)`` per group, one masked add per 16 weights
  (AVX-512) or one table lookup per 8 weights elsewhere, reading the packed bits directly;
- otherwise `product_reference`, the torch reference: each variant's delta is decoded into one
  reused float32 buffer and multiplied (correct for every shape, slow).

Bit layout as `zoo_gym.compression.bitdelta`: value ``8i + j`` is bit ``7 - j`` of byte ``i``,
1 for a positive sign.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from zoo_gym.compression import kernels
from zoo_gym.core.extension import Extension
from zoo_gym.serving.packed import PackedTensor

_COMPILED = Extension("zoo_gym.serving._binary_gemm")
SMALL = 1 << 22  # weights x rows below which the CPU kernel runs on one thread
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
    first = weights[0]
    if x.is_cuda and kernels.available():
        from zoo_gym.serving import kernels as triton_kernels

        return triton_kernels.product(x, weights, starts)
    alike = all(w.group == first.group and w.scales.dtype == first.scales.dtype for w in weights)
    if not (alike and compiled_for(first, x.device)):
        return product_reference(x, weights, starts)
    x = x.contiguous()
    out = torch.empty(x.shape[0], first.shape[0])
    kind = SCALE_KINDS[first.scales.dtype]
    scales = [w.scales.view(torch.int16) if kind < 2 else w.scales for w in weights]
    assert _COMPILED.module is not None
    _COMPILED.module.product(
        x.numpy(),
        out.numpy(),
        list(starts),
        [w.bits.numpy() for w in weights],
        [s.numpy() for s in scales],
        first.shape[1],
        first.group,
        kind,
        threads or (1 if x.shape[0] * first.numel < SMALL else torch.get_num_threads()),
    )
    return out
