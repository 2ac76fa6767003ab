"""Consumers of envelopes that never build a full decoded copy: accumulate and apply.

For BitDelta both are fused: Triton kernels where `kernels.active_for` the target tensor
(CUDA with Triton installed), chunked torch elsewhere; other codecs decode one tensor at a time
into a temporary of that tensor's size. Each tensor is read in its own codec, so an envelope
with several (version 3) takes both paths, a tensor at a time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from zoo_gym.compression import bitdelta, codecs, kernels
from zoo_gym.compression.envelope import (
    check_layout,
    inspect_envelope,
    section_tensors,
    unpack_bitdelta,
    unpacks_together,
    use_triton,
)
from zoo_gym.compression.errors import EnvelopeError
from zoo_gym.core.delta import Layout, numel


def decode_accumulate(
    payloads: Sequence[bytes],
    weights: Sequence[float],
    out: Tensor,
    layout: Layout,
    *,
    max_elements: int,
    backend: str = "auto",
) -> None:
    """``out += sum_i weights[i] * decode(payloads[i])`` for `out` (numel(layout),) float32.

    Each envelope's header, hash, scales and layout are validated before any of it is added,
    so such errors raise `EnvelopeError` without touching `out` for that payload.
    """
    if len(payloads) != len(weights):
        raise ValueError(f"{len(payloads)} payloads but {len(weights)} weights")
    d = numel(layout)
    if out.dtype != torch.float32 or tuple(out.shape) != (d,):
        raise ValueError(f"out must be float32 of shape ({d},), got {out.dtype} {tuple(out.shape)}")
    triton = use_triton(out, backend)
    for payload, weight in zip(payloads, weights, strict=True):
        header = inspect_envelope(payload, max_elements=max_elements)
        check_layout(header, layout)
        if unpacks_together(header):
            unpack_bitdelta(payload, header, out, weight=float(weight), triton=triton)
            continue
        parts = [section_tensors(payload, s) for s in header.sections]
        offset = 0
        for section, (scales, data) in zip(header.sections, parts, strict=True):
            n = section.spec.numel
            target = out[offset : offset + n]
            offset += n
            if section.codec == "bitdelta":
                codecs.check_padding(data, n)
                add = kernels.accumulate if triton else bitdelta.accumulate
                add(
                    data.to(out.device), scales.to(out.device), section.group, target, float(weight)
                )
            else:
                step = torch.empty(n, dtype=torch.float32, device=out.device)
                codecs.decode_tensor(section.codec, scales, data, section.group, step)
                target.add_(step, alpha=float(weight))


def apply_update_(
    params: Mapping[str, Tensor],
    payload: bytes,
    *,
    alpha: float = 1.0,
    max_elements: int,
    backend: str = "auto",
) -> None:
    """In place ``params[name] += alpha * decode(payload)[name]`` for every tensor in `payload`.

    `params` are float32, float16 or bfloat16 (for instance a model's base weights); the sum
    is formed in float32 and rounded once. Raises `EnvelopeError` if the payload is invalid or
    names a tensor missing from `params` or of another shape; header, hash, scale and layout
    errors are found before any weight is modified.
    """
    header = inspect_envelope(payload, max_elements=max_elements)
    for ts in header.layout:
        if ts.name not in params or tuple(params[ts.name].shape) != ts.shape:
            raise EnvelopeError(f"envelope tensor {ts.name} {ts.shape} does not match the weights")
    parts = [section_tensors(payload, s) for s in header.sections]
    for section, (scales, data) in zip(header.sections, parts, strict=True):
        weights = params[section.spec.name]
        triton = use_triton(weights, backend)
        if section.codec == "bitdelta" and (weights.is_contiguous() or not triton):
            codecs.check_padding(data, section.spec.numel)
            apply = kernels.apply_ if triton else bitdelta.apply_
            apply(weights, data.to(weights.device), scales.to(weights.device), section.group, alpha)
            continue
        step = torch.empty(section.spec.numel, dtype=torch.float32, device=weights.device)
        codecs.decode_tensor(section.codec, scales, data, section.group, step)
        flat = weights.view(-1)
        flat.copy_(step.mul_(alpha).add_(flat.float()))
