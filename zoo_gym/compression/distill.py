"""BitDelta scale distillation: fit the scales of 1-bit deltas to the fine-tuned model's logits.

BitDelta [Liu et al., 2024, "BitDelta: Your Fine-Tune May Only Be Worth One Bit", Sec. 3.2]
approximates a fine-tune as ``W_fine ~ W_base + alpha * sign(W_fine - W_base)`` with
``alpha = mean |delta|`` (the L2-optimal scale for each matrix or group), then freezes the
signs and fits the scales on calibration text so that the compressed model's logits match
the fine-tuned model's:

    min_alpha  E_x || logits(W_base + alpha * S; x) - logits(W_fine; x) ||^2

Only the scales train (Adam); the model itself is never modified: both forwards run through
`torch.func.functional_call` with substituted parameters.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import Tensor, nn
from torch.func import functional_call

from zoo_gym.compression.codecs import expand


def expand_scales(scales: Tensor, group: int, shape: tuple[int, ...]) -> Tensor:
    """Per-value scales of `shape` from per-group scales (ceil(n / group),)."""
    return expand(scales, math.prod(shape), group).view(shape)


def _logits(model: nn.Module, params: Mapping[str, Tensor], input_ids: Tensor) -> Tensor:
    out = functional_call(model, dict(params), (input_ids,))
    logits = getattr(out, "logits", out)
    if not isinstance(logits, Tensor):
        raise TypeError("the model must return logits or an object with a .logits tensor")
    return logits.float()


def logit_loss(student: Tensor, teacher: Tensor) -> Tensor:
    """Mean squared logit difference, the BitDelta objective."""
    return torch.mean((student - teacher) ** 2)


def compressed_params(
    base: Mapping[str, Tensor],
    finetuned: Mapping[str, Tensor],
    signs: Mapping[str, Tensor],
    scales: Mapping[str, Tensor],
    groups: Mapping[str, int],
) -> dict[str, Tensor]:
    """``base + scale * sign`` for every name in `signs`, `finetuned` for the other names.

    `signs[name]` is +-1 of the weight's shape; `scales[name]` (ceil(n / groups[name]),).
    """
    params = {name: t for name, t in finetuned.items()}
    for name, sign in signs.items():
        per_value = expand_scales(scales[name], groups[name], tuple(sign.shape))
        params[name] = base[name].float() + per_value * sign
    return params


def distill_scales(
    model: nn.Module,
    base: Mapping[str, Tensor],
    finetuned: Mapping[str, Tensor],
    signs: Mapping[str, Tensor],
    scales: Mapping[str, Tensor],
    groups: Mapping[str, int],
    input_ids: Tensor,
    *,
    steps: int = 100,
    lr: float = 1e-4,
    batch_size: int = 8,
) -> dict[str, Tensor]:
    """Scales that make ``base + scale * sign`` reproduce `finetuned`'s logits (Liu et al., 2024).

    Parameters
    ----------
    model
        Any module whose forward takes input ids (b, t) and returns logits (b, t, V) (or an
        object with ``.logits``), for instance a Hugging Face causal LM; it is not modified.
    base, finetuned
        Full state dicts (name -> tensor) of the base and the fine-tuned model.
    signs
        name -> +-1 tensor of the weight's shape (the frozen BitDelta signs).
    scales
        name -> initial scales (G,), usually ``mean |delta|`` per group.
    groups
        name -> values per scale.
    input_ids
        Calibration token ids (N, t), processed `batch_size` rows per Adam step (the first
        `steps` batches are used, cycling when there are fewer).

    Returns name -> fitted float32 scales (G,), detached.
    """
    if input_ids.dim() != 2 or input_ids.shape[0] == 0:
        raise ValueError(f"input_ids must be (N, t) with N >= 1, got {tuple(input_ids.shape)}")
    fitted = {name: nn.Parameter(s.detach().float().clone()) for name, s in scales.items()}
    frozen_signs = {name: s.detach().float() for name, s in signs.items()}
    fixed = {name: t.detach() for name, t in finetuned.items()}
    with torch.no_grad():
        used = min(input_ids.shape[0], steps * batch_size)  # later batches are never reached
        teacher = [
            _logits(model, fixed, input_ids[i : i + batch_size]) for i in range(0, used, batch_size)
        ]
    optimizer = torch.optim.Adam(list(fitted.values()), lr=lr)
    for step in range(steps):
        index = step % len(teacher)
        batch = input_ids[index * batch_size : (index + 1) * batch_size]
        params = compressed_params(base, fixed, frozen_signs, fitted, groups)
        value = logit_loss(_logits(model, params, batch), teacher[index])
        optimizer.zero_grad()
        value.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
    return {name: p.detach().clone() for name, p in fitted.items()}
