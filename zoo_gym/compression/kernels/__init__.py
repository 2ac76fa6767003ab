"""Triton kernels for BitDelta, imported lazily so the package works without Triton.

The functions here take the same tensors as `zoo_gym.compression.bitdelta` (the torch
reference they are tested against, bit for bit) and run on CUDA tensors, or on CPU tensors
when ``TRITON_INTERPRET=1`` was set before Triton was imported.
"""

from __future__ import annotations

import importlib.util
import os

import torch
from torch import Tensor

MAX_PACK_GROUP = 8192
"""Largest group the fused pack kernel handles in one program (one group per program)."""


def available() -> bool:
    """Whether Triton is installed."""
    return importlib.util.find_spec("triton") is not None


def interpreted() -> bool:
    """Whether kernels run in the Triton interpreter (on CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


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
