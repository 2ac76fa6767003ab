"""One tensor of a BitDelta variant as it is kept in memory: packed signs and group scales."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from zoo_gym.compression import bitdelta


@dataclass(frozen=True)
class PackedTensor:
    """One tensor of a variant: packed signs (ceil(n / 8),) uint8 and group scales (G,) in the
    envelope's scale dtype (float16, bfloat16 or float32), never unpacked floats."""

    shape: tuple[int, ...]
    bits: Tensor
    scales: Tensor
    group: int

    @property
    def numel(self) -> int:
        return _numel(self.shape)

    @property
    def nbytes(self) -> int:
        return self.bits.numel() + self.scales.numel() * self.scales.element_size()

    def to(self, device: torch.device | str) -> PackedTensor:
        return PackedTensor(self.shape, self.bits.to(device), self.scales.to(device), self.group)

    def decode(self, out: Tensor | None = None) -> Tensor:
        """The delta as float32 of `shape`, written into `out` (n,) float32 when given."""
        flat = torch.empty(self.numel, device=self.bits.device) if out is None else out
        bitdelta.unpack(self.bits, self.scales.float(), self.group, flat[: self.numel])
        return flat[: self.numel].view(self.shape)

    def decode_rows(self, index: Tensor) -> Tensor:
        """Rows `index` (k,) of a 2-D delta (rows, cols) as float32 (k, cols): only the signs
        and scales of those rows are read (an embedding's looked-up tokens)."""
        cols = self.shape[1]
        flat = index.reshape(-1, 1).long() * cols + torch.arange(cols, device=index.device)
        byte = self.bits[flat // 8].to(torch.int32)
        positive = (byte >> (7 - flat % 8)) & 1
        scale = self.scales[flat // self.group].float()
        return torch.where(positive.bool(), scale, -scale)


def alike(weights: Sequence[PackedTensor]) -> bool:
    """Whether `weights` share one group size and scale dtype (one kernel call takes them)."""
    first = weights[0]
    return all(w.group == first.group and w.scales.dtype == first.scales.dtype for w in weights)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for size in shape:
        n *= size
    return n
