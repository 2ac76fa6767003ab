"""One tensor of a BitDelta variant as it is kept in memory: packed signs and group scales."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from zoo_gym.compression import bitdelta

LANES = 16  # rows of a block whose signs `PackedTensor.interleaved` lays side by side


@dataclass(frozen=True)
class PackedTensor:
    """One tensor of a variant: packed signs (ceil(n / 8),) uint8 and group scales (G,) in the
    envelope's scale dtype (float16, bfloat16 or float32), never unpacked floats.

    `lanes`: the signs of each whole block of `LANES` rows of a (rows, cols) weight lie
    interleaved by 4 bytes, as the CPU kernel reads 16 rows at once: bytes 4d .. 4d + 3 of the
    block's row l are at 64 d + 4 l of the block's bytes. The block keeps its place (rows
    16b .. 16b + 15 take the same bytes either way) and the rows after the last whole block
    stay row by row (see `interleaved`)."""

    shape: tuple[int, ...]
    bits: Tensor
    scales: Tensor
    group: int
    lanes: bool = False

    @property
    def numel(self) -> int:
        return _numel(self.shape)

    @property
    def nbytes(self) -> int:
        return self.bits.numel() + self.scales.numel() * self.scales.element_size()

    def to(self, device: torch.device | str) -> PackedTensor:
        """On `device`; off the CPU row by row (the GPU kernels read rows)."""
        cpu = torch.device(device).type == "cpu"
        bits = (self.bits if cpu else self.row_bits()).to(device)
        return PackedTensor(
            self.shape, bits, self.scales.to(device), self.group, self.lanes and cpu
        )

    def interleaved(self) -> PackedTensor:
        """This weight with `lanes`, where it is a matrix whose rows are whole 4-byte words
        (cols % 32 == 0); itself otherwise."""
        if self.lanes or len(self.shape) != 2 or self.shape[1] % 32:
            return self
        bits = _relaid(self.bits, self.shape, to_lanes=True)
        return PackedTensor(self.shape, bits, self.scales, self.group, lanes=True)

    def row_bits(self) -> Tensor:
        """The signs row by row (a new tensor where they are interleaved)."""
        return _relaid(self.bits, self.shape, to_lanes=False) if self.lanes else self.bits

    def decode(self, out: Tensor | None = None) -> Tensor:
        """The delta as float32 of `shape`, written into `out` (n,) float32 when given."""
        flat = torch.empty(self.numel, device=self.bits.device) if out is None else out
        bitdelta.unpack(self.row_bits(), self.scales.float(), self.group, flat[: self.numel])
        return flat[: self.numel].view(self.shape)

    def decode_rows(self, index: Tensor) -> Tensor:
        """Rows `index` (k,) of a 2-D delta (rows, cols) as float32 (k, cols): only the signs
        and scales of those rows are read (an embedding's looked-up tokens)."""
        cols = self.shape[1]
        row = index.reshape(-1, 1).long()
        col = torch.arange(cols, device=index.device)
        flat = row * cols + col
        if self.lanes:  # rows of whole blocks: their 4-byte words side by side (cols % 32 == 0)
            whole = row < self.shape[0] - self.shape[0] % LANES
            row_bytes = cols // 8
            start = torch.where(
                whole, row // LANES * LANES * row_bytes + row % LANES * 4, row * row_bytes
            )
            byte = start + torch.where(whole, col // 32 * 4 * LANES + col % 32 // 8, col // 8)
        else:
            byte = flat // 8
        positive = (self.bits[byte].to(torch.int32) >> (7 - flat % 8)) & 1
        scale = self.scales[flat // self.group].float()
        return torch.where(positive.bool(), scale, -scale)


def _relaid(bits: Tensor, shape: tuple[int, ...], *, to_lanes: bool) -> Tensor:
    """`bits` of a (rows, cols) weight with each whole block of `LANES` rows interleaved by
    4-byte words (`to_lanes`) or back to rows; the rows after the last block as they are."""
    rows, words = shape[0], shape[1] // 32
    blocks = rows // LANES
    head = blocks * LANES * words * 4
    out = torch.empty_like(bits)
    out[head:] = bits[head:]
    # moved as 4-byte words, not bytes: 2.5 times as fast (an LM head's 17 MB on one thread)
    source = bits[:head] if bits.storage_offset() % 4 == 0 else bits[:head].clone()
    block = source.view(torch.int32).view(blocks, *((LANES, words) if to_lanes else (words, LANES)))
    out[:head].view(torch.int32).view_as(block.transpose(1, 2)).copy_(block.transpose(1, 2))
    return out


def alike(weights: Sequence[PackedTensor]) -> bool:
    """Whether `weights` share one group size, scale dtype and layout (one kernel call takes
    them)."""
    first = weights[0]
    return all(
        w.group == first.group and w.scales.dtype == first.scales.dtype and w.lanes == first.lanes
        for w in weights
    )


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for size in shape:
        n *= size
    return n
