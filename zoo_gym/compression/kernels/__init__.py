"""Triton kernels for BitDelta, imported lazily so the package works without Triton.

The functions here take the same tensors as `zoo_gym.compression.bitdelta` (the torch
reference they are tested against, bit for bit) and run on CUDA tensors, or on CPU tensors
when ``TRITON_INTERPRET=1`` was set before Triton was imported.

`active_for` is the one switch between the two paths: the envelope's encode, decode,
accumulate and apply use the kernels for a tensor exactly when it says so. That is every CUDA
tensor when Triton is installed; CPU tensors go through the kernels only when
``ZOO_TRITON_ON_CPU=1`` is set as well as ``TRITON_INTERPRET=1``, which lets tests run the
product's GPU path on a machine without a GPU (slowly: the interpreter runs the kernels in
numpy).

Byte identity. A payload's bytes must not depend on the machine that encoded it (they are
hashed, signed and pinned by tests). Sign bits are exact anywhere; a scale (mean |x| of a group)
is a float32 sum whose last bit depends on the order of the additions. The CPU path sums each
group with one ``torch.sum`` over a contiguous float32 row, which PyTorch's CPU kernel
(`cascade_sum`) adds in a fixed order of 8-lane vectors: 4 interleaved accumulators, blocks of
16 rows of 4 vectors folded into a second level, the lanes added last from left to right (the
CPU path's compiled pass, `zoo_gym/compression/_bitpack.c`, performs these additions itself,
in this order). x86 builds use that 8-lane order whatever the CPU offers (measured with
ATEN_CPU_CAPABILITY=default, avx2 and avx512, 1 to 8 threads, groups 8 to 8192). The pack kernel performs the same additions
in the same order with no fused multiply-add and divides with IEEE rounding, so its scales equal
the CPU's bit for bit for every group it takes: a multiple of 8 up to MAX_PACK_GROUP. Any other
group (row or matrix granularity with such a length, or a larger group) is packed on the CPU,
as are CUDA tensors when Triton is missing: the torch path on a GPU adds in another order.
Left open: a PyTorch build whose float vectors are not 8 lanes wide (aarch64 builds with 4-lane
NEON vectors, not measured here) would itself give other CPU bytes, as would a PyTorch release
that changes `cascade_sum`; `tests/compression/test_kernels.py` compares the two paths bit for
bit and fails if that happens, as `tests/compression/test_bitpack.py` does for the compiled
pass against ``torch.sum``.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import os
from collections.abc import Sequence

import torch
from torch import Tensor

ON_CPU = "ZOO_TRITON_ON_CPU"
"""Environment variable: 1 runs the kernels on CPU tensors too (needs TRITON_INTERPRET=1)."""

MAX_PACK_GROUP = 8192
"""Largest group the fused pack kernel handles in one program (one group per program)."""


@functools.cache
def available() -> bool:
    """Whether Triton is installed (looked up once: a lookup walks the import path)."""
    return importlib.util.find_spec("triton") is not None


def interpreted() -> bool:
    """Whether kernels run in the Triton interpreter (on CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def active_for(where: Tensor | torch.device | str) -> bool:
    """Whether the envelope functions run the kernels for tensors on `where` (see the module
    docstring): CUDA with Triton installed, or the CPU under the interpreter when asked for."""
    device = where.device if isinstance(where, Tensor) else torch.device(where)
    if device.type == "cuda":
        return available()
    on_cpu = os.environ.get(ON_CPU, "0") not in ("", "0")
    return device.type == "cpu" and on_cpu and interpreted() and available()


def can_pack(group: int) -> bool:
    """Whether the fused pack kernel handles `group` (a multiple of 8, at most MAX_PACK_GROUP)."""
    return group % 8 == 0 and group <= MAX_PACK_GROUP


def pack(x: Tensor, group: int) -> tuple[Tensor, Tensor]:
    """Signs and group scales of `x` (n,) float32 in one pass -> ((ceil(n/8),) uint8, (G,) float32).

    Requires ``can_pack(group)``.
    """
    from zoo_gym.compression.kernels import bitdelta_triton

    if not can_pack(group):
        raise ValueError(f"pack kernel needs a group that is a multiple of 8 <= {MAX_PACK_GROUP}")
    n = x.numel()
    bits = torch.empty((n + 7) // 8, dtype=torch.uint8, device=x.device)
    scales = torch.empty(-(-n // group), dtype=torch.float32, device=x.device)
    bitdelta_triton.pack(x.contiguous(), bits, scales, group)
    return bits, scales


def pack_many(xs: Sequence[Tensor], group: int) -> tuple[list[Tensor], Tensor]:
    """`zoo_gym.compression.bitdelta.pack_many` through the pack kernel, on the tensors' device.

    `xs` are flat contiguous float32 tensors (n_i,) on one device. Signs and scales of all
    tensors are written into one device buffer each and copied to the CPU once: returns
    (packed signs per tensor (ceil(n_i / 8),) uint8, scales (sum_i ceil(n_i / group),)
    float32), both on the CPU, byte for byte those of the CPU path. Requires
    ``can_pack(group)``.
    """
    from zoo_gym.compression.kernels import bitdelta_triton

    if not can_pack(group):
        raise ValueError(f"pack kernel needs a group that is a multiple of 8 <= {MAX_PACK_GROUP}")
    if not xs:
        return [], torch.empty(0, dtype=torch.float32)
    device = xs[0].device
    nbytes = [(x.numel() + 7) // 8 for x in xs]
    ngroups = [-(-x.numel() // group) for x in xs]
    bits = torch.empty(sum(nbytes), dtype=torch.uint8, device=device)
    scales = torch.empty(sum(ngroups), dtype=torch.float32, device=device)
    boff = list(itertools.accumulate(nbytes, initial=0))
    goff = list(itertools.accumulate(ngroups, initial=0))
    for i, x in enumerate(xs):
        bitdelta_triton.pack(
            x.contiguous(), bits[boff[i] : boff[i + 1]], scales[goff[i] : goff[i + 1]], group
        )
    return list(torch.split(bits.cpu(), nbytes)), scales.cpu()


def unpack_many(
    packed: Sequence[Tensor],
    scales: Tensor,
    ns: Sequence[int],
    group: int,
    out: Tensor,
    *,
    weight: float | None = None,
) -> None:
    """`zoo_gym.compression.bitdelta.unpack_many` through the unpack kernel on `out`'s device.

    Writes (``weight=None``) or adds ``+-(weight * scale)`` for tensors laid end to end in the
    contiguous `out` (sum_i n_i,) float32; the signs and scales go to the device in one copy
    each.
    """
    voff = list(itertools.accumulate(ns, initial=0))
    outs = [out[voff[i] : voff[i + 1]] for i in range(len(ns))]
    unpack_each(packed, scales, group, outs, weight=weight)


def unpack_each(
    packed: Sequence[Tensor],
    scales: Tensor,
    group: int,
    outs: Sequence[Tensor],
    *,
    weight: float | None = None,
) -> None:
    """`unpack_many` into separate contiguous float32 tensors `outs[i]` (n_i,) on one device."""
    from zoo_gym.compression.kernels import bitdelta_triton

    if not packed:
        return
    device = outs[0].device
    bits = torch.cat(list(packed)).to(device)
    steps = scales.float().to(device).contiguous()
    boff = list(itertools.accumulate((p.numel() for p in packed), initial=0))
    goff = list(itertools.accumulate((-(-o.numel() // group) for o in outs), initial=0))
    for i, out in enumerate(outs):
        bitdelta_triton.unpack(
            bits[boff[i] : boff[i + 1]],
            steps[goff[i] : goff[i + 1]],
            out,
            group,
            1.0 if weight is None else weight,
            weight is not None,
        )


def unpack(packed: Tensor, scales: Tensor, group: int, out: Tensor) -> None:
    """``out = decode(packed, scales)`` into contiguous `out` (n,) float32."""
    from zoo_gym.compression.kernels import bitdelta_triton

    bitdelta_triton.unpack(packed, scales.float().contiguous(), out, group, 1.0, False)


def accumulate(packed: Tensor, scales: Tensor, group: int, out: Tensor, weight: float) -> None:
    """Fused ``out += weight * decode(packed, scales)`` into contiguous `out` (n,) float32."""
    from zoo_gym.compression.kernels import bitdelta_triton

    bitdelta_triton.unpack(packed, scales.float().contiguous(), out, group, weight, True)


def apply_(weights: Tensor, packed: Tensor, scales: Tensor, group: int, alpha: float) -> None:
    """Fused in-place ``weights += alpha * decode(packed, scales)`` (fp32, fp16 or bf16)."""
    from zoo_gym.compression.kernels import bitdelta_triton

    if not weights.is_contiguous():
        raise ValueError("apply_ needs contiguous weights")
    bitdelta_triton.apply_(weights, packed, scales.float().contiguous(), group, alpha)
