"""Compressed variants of published versions: the full-weight delta to the parent as BitDelta.

The variant ``models/variants/<V>-from-<P>.zgde`` (about 1/14 of V's bf16 size) rebuilds V's
weights as ``P + decode(variant)`` (`apply_variant`). It is written for an operator to hand
out; the coordinator does not serve variants to contributors yet, and a variant's record is
hashed, not signed. BitDelta [Liu et al., 2024] keeps one sign per weight and one
scale per group; with ``distill=True`` the scales are refitted so that the variant's logits
on the coordinator's validation prompts match V's (`zoo_gym.compression.distill`).

Each variant has a JSON record beside it (format, versions, codec, sha256, size), so a
reader checks the envelope's hash before decoding. Variants live outside the version
directories: `ModelRegistry.publish` copies a parent's extra files into the next version.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor

from zoo_gym.compression import CodecSpec, apply_update_, bitdelta, encode, inspect_envelope
from zoo_gym.compression.distill import distill_scales, expand_scales
from zoo_gym.compression.envelope import bitdelta_parts
from zoo_gym.coordinator.registry import ModelRegistry
from zoo_gym.core.files import write_atomic
from zoo_gym.core.hashing import sha256_bytes

VARIANT_FORMAT = 1
DIRECTORY = "variants"


class VariantError(ValueError):
    """A variant is missing, does not match its record, or does not fit the parent."""


@dataclass(frozen=True)
class Variant:
    version: str
    parent: str
    codec: str
    group_size: int
    sha256: str
    size: int
    distilled: bool
    format: int = VARIANT_FORMAT


def variant_paths(root: Path, version: str, parent: str) -> tuple[Path, Path]:
    """(envelope, JSON record) of the variant `version`-from-`parent` under the models root."""
    stem = root / DIRECTORY / f"{version}-from-{parent}"
    return stem.with_suffix(".zgde"), stem.with_suffix(".json")


def float_weights(
    registry: ModelRegistry, version: str, parent: str
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """float32 weights of `version` and of `parent`; both must hold the same tensors."""
    new, old = registry.load_state_dict(version), registry.load_state_dict(parent)
    if {k: tuple(v.shape) for k, v in new.items()} != {k: tuple(v.shape) for k, v in old.items()}:
        raise VariantError(f"{version} and {parent} hold different tensors; no delta variant")
    return {k: v.float() for k, v in new.items()}, {k: v.float() for k, v in old.items()}


def calibration_ids(tokenizer_dir: Path, validation: Path, *, length: int = 32) -> Tensor:
    """Prompts of the validation set, tokenized, as one stream cut into rows (N, `length`)."""
    from transformers import AutoTokenizer

    from zoo_gym.core.chat import encode_prompt, to_conversation

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    stream: list[int] = []
    for line in validation.read_text().splitlines():
        if line.strip():
            stream += encode_prompt(tokenizer, to_conversation(json.loads(line)))
    rows = len(stream) // length
    if rows == 0:
        raise VariantError(f"{validation} has fewer than {length} prompt tokens to distill on")
    return torch.tensor(stream[: rows * length]).view(rows, length)


def _distilled_delta(
    parent_dir: Path,
    base: dict[str, Tensor],
    finetuned: dict[str, Tensor],
    delta: dict[str, Tensor],
    spec: CodecSpec,
    input_ids: Tensor,
    steps: int,
) -> dict[str, Tensor]:
    """``scale * sign`` per tensor with the scales fitted to `finetuned`'s logits (`base` is the
    parent's weights, loaded as a model from `parent_dir`)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(parent_dir, dtype=torch.float32)
    payload = encode(delta, spec)
    header = inspect_envelope(payload, max_elements=sum(t.numel() for t in delta.values()))
    packed, scales = bitdelta_parts(payload, header)
    signs, initial, groups = {}, {}, {}
    start = 0
    for section, bits in zip(header.sections, packed, strict=True):
        name, shape = section.spec.name, section.spec.shape
        positive = bitdelta.unpack_signs(bits, section.spec.numel).view(shape)
        signs[name] = torch.where(positive, 1.0, -1.0)
        initial[name] = scales[start : start + section.n_groups]
        groups[name] = section.group
        start += section.n_groups
    # the model's parameter names must match the state dict's (tied weights appear once)
    known = dict(model.named_parameters())
    fit = [name for name in signs if name in known]
    fitted = distill_scales(
        model,
        base,
        finetuned,
        {n: signs[n] for n in fit},
        {n: initial[n] for n in fit},
        {n: groups[n] for n in fit},
        input_ids,
        steps=steps,
        lr=3e-4,
    )
    out = {}
    for name, sign in signs.items():
        scale = fitted.get(name, initial[name])
        out[name] = expand_scales(scale, groups[name], tuple(sign.shape)) * sign
    return out


def write_variant(
    registry: ModelRegistry,
    version: str,
    *,
    spec: CodecSpec | None = None,
    calibration: Tensor | None = None,
    steps: int = 100,
) -> Variant:
    """Write the BitDelta variant of `version` against its parent (distilled when
    `calibration` ids (N, t) are given) and its record; returns the record."""
    spec = spec or CodecSpec("bitdelta", group_size=128)
    if spec.codec != "bitdelta":
        raise VariantError(f"variants are BitDelta envelopes, not {spec.codec}")
    try:
        manifest = registry.get(version).manifest
    except KeyError:
        raise VariantError(
            f"no published version {version}; see `gym-coordinator admin models`"
        ) from None
    if manifest.parent is None:
        raise VariantError(f"{version} is the first version; it has no parent to be a delta of")
    finetuned, base = float_weights(registry, version, manifest.parent)
    delta = {name: finetuned[name] - base[name] for name in sorted(finetuned)}
    if calibration is not None:
        delta = _distilled_delta(
            registry.root / manifest.parent, base, finetuned, delta, spec, calibration, steps
        )
    del finetuned, base  # only the delta is needed from here: two float32 models fewer in memory
    payload = encode(delta, spec)
    envelope, record_path = variant_paths(registry.root, version, manifest.parent)
    envelope.parent.mkdir(parents=True, exist_ok=True)
    record = Variant(
        version=version,
        parent=manifest.parent,
        codec=spec.codec,
        group_size=spec.group_size,
        sha256=sha256_bytes(payload),
        size=len(payload),
        distilled=calibration is not None,
    )
    write_atomic(envelope, payload)
    write_atomic(record_path, json.dumps(asdict(record), sort_keys=True, indent=1).encode())
    return record


def apply_variant(parent_weights: dict[str, Tensor], payload: bytes) -> dict[str, Tensor]:
    """``parent + decode(payload)`` per tensor, in the parent's dtypes (a new dict)."""
    limit = sum(t.numel() for t in parent_weights.values())
    header = inspect_envelope(payload, max_elements=limit)
    if {ts.name: ts.shape for ts in header.layout} != {
        k: tuple(v.shape) for k, v in parent_weights.items()
    }:
        raise VariantError("the variant's tensors differ from the parent's weights")
    rebuilt = {name: w.clone() for name, w in parent_weights.items()}
    apply_update_(rebuilt, payload, max_elements=limit)  # float32 sums, rounded once
    return rebuilt
