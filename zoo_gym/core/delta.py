"""Deltas: a model update as a mapping from tensor name to tensor.

A `Delta` is what a contributor sends and what aggregation works on. Aggregation
wants one flat vector per update, so a delta is flattened against a `Layout`:
the ordered names, shapes and dtypes of its tensors. Flattening is deterministic
(names in layout order) so every client and the coordinator agree on coordinates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

Delta = dict[str, Tensor]


@dataclass(frozen=True)
class TensorSpec:
    """Name, shape and dtype of one tensor of a delta."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


Layout = tuple[TensorSpec, ...]


def layout_of(delta: Delta) -> Layout:
    """The layout of `delta`, tensors sorted by name."""
    return tuple(
        TensorSpec(name, tuple(delta[name].shape), str(delta[name].dtype).removeprefix("torch."))
        for name in sorted(delta)
    )


def numel(layout: Layout) -> int:
    """Total number of scalars described by `layout`."""
    return sum(spec.numel for spec in layout)


def flatten(delta: Delta, layout: Layout, *, out: Tensor | None = None) -> Tensor:
    """Concatenate `delta` in layout order into a float32 vector `(d,)` (or into `out`)."""
    d = numel(layout)
    if out is None:
        out = torch.empty(d, dtype=torch.float32)
    if out.shape != (d,):
        raise ValueError(f"out has shape {tuple(out.shape)}, layout needs ({d},)")
    offset = 0
    for spec in layout:
        tensor = delta[spec.name]
        if tuple(tensor.shape) != spec.shape:
            raise ValueError(f"{spec.name}: shape {tuple(tensor.shape)} != layout {spec.shape}")
        out[offset : offset + spec.numel].copy_(tensor.reshape(-1))
        offset += spec.numel
    return out


def unflatten(vector: Tensor, layout: Layout) -> Delta:
    """Split a `(d,)` vector back into named tensors (views into `vector`)."""
    if vector.shape != (numel(layout),):
        raise ValueError(f"vector has shape {tuple(vector.shape)}, layout needs ({numel(layout)},)")
    delta: Delta = {}
    offset = 0
    for spec in layout:
        delta[spec.name] = vector[offset : offset + spec.numel].view(spec.shape)
        offset += spec.numel
    return delta


def delta_norm(delta: Delta) -> float:
    """Global L2 norm of all tensors in `delta`, accumulated in float64."""
    total = sum(float(t.double().pow(2).sum()) for t in delta.values())
    return math.sqrt(total)
