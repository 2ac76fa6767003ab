"""FFA-LoRA: LoRA with frozen, shared A matrices [Sun et al., 2024].

LoRA [Hu et al., 2022] adds ``W' = W + (alpha / r) * B @ A`` to each target
linear layer, with ``W`` `(out, in)`, ``B`` `(out, r)` and ``A`` `(r, in)`.
FFA-LoRA ("Improving LoRA in Privacy-preserving Federated Learning", ICLR 2024)
freezes ``A`` at its random initialisation and trains only ``B``. Here ``A`` is
a pure function of the round seed and the module name, identical on every
machine, so the update a client sends is just its ``B`` matrices and
aggregation is exact and linear: ``mean_i(B_i) @ A == mean_i(B_i @ A)``.

Module names are the base model's (``"model.layers.0.self_attn.q_proj"``), never
peft's prefixed ones.

Orientation: ``nn.Linear`` stores its weight `(out, in)`; transformers' ``Conv1D``
(GPT-2 and its family) stores it `(in, out)`. A state dict alone cannot tell the
two apart, so the modules stored `(in, out)` are named in
`LoraSpec.fan_in_fan_out` (peft's name for the same thing). A model knows its
own (`linear_layers`); the coordinator reads them from the base's config.json
(`linear_layers_of`, a skeleton on the meta device) and fills them in with
`for_base`. Shapes given as `(out, in)` (`target_weights`, ``B`` `(out, r)`,
``A`` `(r, in)`) are the logical ones; dense deltas keyed by a weight's name
(`dense_delta`, the dense adapters' updates) have the weight's stored shape.

A new epoch of A (the coordinator keeps one A for ``lora_a_rounds`` rounds) starts with a
round whose FFA update also carries, per module, ``"<module>.lora_B_carry"`` `(out, r)`: the
client's error-feedback residual for the previous epoch's A (`carry_key`; the task's
``carry_a_seed``). It is merged with that A: ``W += scaling * (B @ A_new + B_carry @ A_old)``
(`update_shapes(..., carry=True)`, `merge_ffa(..., carry_seed=...)`).

The other adapters (plain LoRA, DoRA, QLoRA, full fine-tuning) send dense weight
deltas keyed by base weight names; `update_shapes` says what an update of each
adapter consists of and `merge_update` merges either kind (`merge_ffa`,
`merge_dense`).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from transformers import PretrainedConfig

from zoo_gym.core.delta import Delta
from zoo_gym.core.protocol import DEFAULT_TARGETS

_B_SUFFIX = ".lora_B"
_CARRY_SUFFIX = ".lora_B_carry"


@dataclass(frozen=True)
class LoraSpec:
    """Which linear layers get an adapter, its rank and its scale ``alpha / rank``.

    A module is targeted when the last part of its name is in `target_modules`.
    `fan_in_fan_out` names the base's modules whose weight is stored `(in, out)`
    (``Conv1D``); it matters only where the spec is applied to a state dict
    (see `for_base`).
    """

    rank: int = 8
    alpha: float = 16.0
    target_modules: tuple[str, ...] = DEFAULT_TARGETS
    fan_in_fan_out: frozenset[str] = frozenset()

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def frozen_a(seed: int, module_name: str, in_features: int, rank: int) -> Tensor:
    """The frozen A `(rank, in_features)` float32 of `module_name` for round `seed`.

    Drawn like peft's default init (kaiming-uniform with ``a = sqrt(5)``, i.e.
    U(-1/sqrt(in), 1/sqrt(in))) from a CPU generator seeded with
    SHA-256(seed, module_name), so every machine gets the same bits.
    """
    digest = hashlib.sha256(f"zoo-gym/ffa-lora/{seed}/{module_name}".encode()).digest()
    generator = torch.Generator(device="cpu").manual_seed(int.from_bytes(digest[:8], "big") >> 1)
    bound = 1.0 / math.sqrt(in_features)
    uniform = torch.rand((rank, in_features), generator=generator, dtype=torch.float32)
    return uniform.mul_(2 * bound).sub_(bound)


def linear_layers(model: nn.Module) -> dict[str, bool]:
    """Every linear layer of `model`: module name -> whether its weight is stored `(in, out)`
    (transformers' ``Conv1D``) rather than `(out, in)` (``nn.Linear``)."""
    from transformers.pytorch_utils import Conv1D

    return {
        name: isinstance(module, Conv1D)
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear | Conv1D)
    }


def linear_layers_of(model_dir_or_config: Path | PretrainedConfig) -> dict[str, bool]:
    """`linear_layers` of the causal LM that a config (or a directory's config.json) describes,
    as its checkpoint stores them (a quantised model's own modules may differ).

    The model is built on the meta device: no weights are read and nothing is allocated.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

    config = model_dir_or_config
    if not isinstance(config, PretrainedConfig):
        config = AutoConfig.from_pretrained(config)  # type: ignore[no-untyped-call]
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    assert isinstance(skeleton, nn.Module)
    return linear_layers(skeleton)


def for_base(spec: LoraSpec, linear: Mapping[str, bool], *, adapter: str) -> LoraSpec:
    """`spec` for a base with these `linear_layers`: their orientation in `fan_in_fan_out`.

    Refuses (ValueError, one line) target modules that name none of the base's linear
    layers, unless the adapter is ``full`` (which trains every weight).
    """
    targeted = [name for name in linear if name.rpartition(".")[2] in spec.target_modules]
    if adapter != "full" and not targeted:
        names = ", ".join(sorted({name.rpartition(".")[2] for name in linear}))
        raise ValueError(
            f"none of the target modules ({', '.join(spec.target_modules)}) is a linear layer "
            f"of the base model; its linear layers are {names}: name some of these in "
            "target_modules"
        )
    transposed = frozenset(name for name, fan_in_fan_out in linear.items() if fan_in_fan_out)
    return replace(spec, fan_in_fan_out=transposed)


def target_weights(
    model_or_state_dict: nn.Module | Mapping[str, Tensor], spec: LoraSpec
) -> dict[str, tuple[int, int]]:
    """Target modules of a base model (or its state dict) and their weight shape `(out, in)`.

    The orientation comes from the module types of a model, from `spec.fan_in_fan_out` for a
    state dict: a ``Conv1D`` weight stored `(in, out)` is reported `(out, in)` all the same.
    """
    state: Mapping[str, Tensor]
    if isinstance(model_or_state_dict, nn.Module):
        state = model_or_state_dict.state_dict()
        transposed = {n for n, t in linear_layers(model_or_state_dict).items() if t}
    else:
        state, transposed = model_or_state_dict, set(spec.fan_in_fan_out)
    targets: dict[str, tuple[int, int]] = {}
    for key, tensor in state.items():
        module, _, leaf = key.rpartition(".")
        if leaf == "weight" and module.rpartition(".")[2] in spec.target_modules:
            if tensor.dim() != 2:
                raise ValueError(f"{key}: target weight must be 2-D, got {tuple(tensor.shape)}")
            rows, columns = int(tensor.shape[0]), int(tensor.shape[1])
            targets[module] = (columns, rows) if module in transposed else (rows, columns)
    return targets


def stored(delta: Tensor, module: str, spec: LoraSpec) -> Tensor:
    """A delta `(out, in)` of `module`'s weight in the orientation the weight is stored in."""
    return delta.T.contiguous() if module in spec.fan_in_fan_out else delta


def update_key(module_name: str) -> str:
    """Key of a module's B matrix in an update: ``"<module>.lora_B"``."""
    return module_name + _B_SUFFIX


def carry_key(module_name: str) -> str:
    """Key of a module's carried B `(out, r)` for the previous epoch's A, sent in the first
    round of an epoch of A: ``"<module>.lora_B_carry"``."""
    return module_name + _CARRY_SUFFIX


def module_of(key: str) -> str:
    """Inverse of `update_key` and `carry_key`."""
    for suffix in (_B_SUFFIX, _CARRY_SUFFIX):
        if key.endswith(suffix):
            return key.removesuffix(suffix)
    raise ValueError(
        f"{key!r} is not an FFA-LoRA update key (expected '<module>.lora_B' or "
        "'<module>.lora_B_carry')"
    )


def is_carry(key: str) -> bool:
    """Whether `key` names a carried B (`carry_key`) rather than a round's own B."""
    return key.endswith(_CARRY_SUFFIX)


def dense_delta(
    update: Delta,
    *,
    spec: LoraSpec,
    seed: int,
    shapes: Mapping[str, tuple[int, int]],
    carry_seed: int | None = None,
) -> Delta:
    """Map each ``"<module>.lora_B"`` `(out, r)` to ``"<module>.weight"`` = scaling * B @ A.

    `shapes` gives each module's weight shape `(out, in)` (see `target_weights`);
    A's width is ``in``. A ``"<module>.lora_B_carry"`` (`carry_key`) goes with the A of
    `carry_seed` (the previous epoch's) and adds to the same weight's delta. Each delta has
    its weight's stored shape (transposed to `(in, out)` for the modules in
    `spec.fan_in_fan_out`, as peft merges a ``Conv1D``). The result is float32 on the CPU.
    """
    dense: Delta = {}
    for key, b in sorted(update.items()):
        module = module_of(key)
        if module not in shapes:
            raise ValueError(f"{key}: {module!r} is not a target module of the base model")
        out_features, in_features = shapes[module]
        if tuple(b.shape) != (out_features, spec.rank):
            raise ValueError(
                f"{key}: shape {tuple(b.shape)}, expected ({out_features}, {spec.rank})"
            )
        a_seed = seed
        if is_carry(key):
            if carry_seed is None:
                raise ValueError(f"{key}: a carried B needs the seed of the previous epoch's A")
            a_seed = carry_seed
        a = frozen_a(a_seed, module, in_features, spec.rank)  # (r, in)
        delta = stored(spec.scaling * (b.detach().float().cpu() @ a), module, spec)  # (out, in)
        name = module + ".weight"
        dense[name] = dense[name] + delta if name in dense else delta
    return dense


def merge_ffa(
    state_dict: dict[str, Tensor],
    update: Delta,
    *,
    spec: LoraSpec,
    seed: int,
    carry_seed: int | None = None,
) -> None:
    """Add ``scaling * B @ A`` of every module in `update` to `state_dict`, in place (and
    ``scaling * B_carry @ A_old`` of its carried Bs, A_old from `carry_seed`).

    The sum is formed in float32 and written back in each weight's own dtype, one module at
    a time (the dense deltas of all target modules together are most of a model's size).
    """
    shapes: dict[str, tuple[int, int]] = {}
    for key in update:
        module = module_of(key)
        weight = state_dict.get(module + ".weight")
        if weight is not None and weight.dim() == 2:
            rows, columns = int(weight.shape[0]), int(weight.shape[1])
            shapes[module] = (columns, rows) if module in spec.fan_in_fan_out else (rows, columns)
    parts: dict[str, Delta] = {}  # module -> its B (and carried B)
    for key, b in update.items():
        parts.setdefault(module_of(key), {})[key] = b
    with torch.no_grad():
        for part in parts.values():  # one module's (out, in) delta in memory at a time
            dense = dense_delta(part, spec=spec, seed=seed, shapes=shapes, carry_seed=carry_seed)
            for name, delta in dense.items():
                weight = state_dict[name]
                weight.copy_((weight.float() + delta.to(weight.device)).to(weight.dtype))


def merge_dense(state_dict: dict[str, Tensor], delta: Delta) -> None:
    """Add each tensor of `delta` to the `state_dict` entry of the same name, in place.

    For the dense adapters (``lora``, ``dora``, ``qlora``, ``full``) whose updates are
    keyed by base weight names. The sum is formed in float32 and written back in each
    weight's own dtype.
    """
    for name, tensor in delta.items():
        weight = state_dict.get(name)
        if weight is None or tuple(weight.shape) != tuple(tensor.shape):
            found = "absent" if weight is None else f"shape {tuple(weight.shape)}"
            raise ValueError(
                f"{name}: the update's shape {tuple(tensor.shape)} does not fit the base ({found})"
            )
    with torch.no_grad():
        for name, tensor in delta.items():
            weight = state_dict[name]
            summed = weight.float() + tensor.detach().float().to(weight.device)
            weight.copy_(summed.to(weight.dtype))


def merge_update(
    state_dict: dict[str, Tensor],
    update: Delta,
    *,
    adapter: str,
    spec: LoraSpec,
    seed: int,
    carry_seed: int | None = None,
) -> None:
    """Merge one (aggregated) update of `adapter` into `state_dict`, in place.

    ``ffa_lora``: ``W += scaling * B @ A`` (`merge_ffa`), plus ``scaling * B_carry @ A_old``
    in the first round of an epoch of A (A_old from `carry_seed`); every other adapter sends
    dense deltas keyed by weight name: ``W += delta`` (`merge_dense`).
    """
    if adapter == "ffa_lora":
        merge_ffa(state_dict, update, spec=spec, seed=seed, carry_seed=carry_seed)
    else:
        merge_dense(state_dict, update)


def update_shapes(
    state_dict: Mapping[str, Tensor], *, adapter: str, spec: LoraSpec, carry: bool = False
) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor an update of `adapter` consists of, for this base.

    ``ffa_lora``: ``"<module>.lora_B"`` `(out, rank)`, and with `carry` (the first round of
    an epoch of A, after the first epoch) ``"<module>.lora_B_carry"`` `(out, rank)` as well;
    ``lora`` / ``dora`` / ``qlora``:
    ``"<module>.weight"`` of each target module, in its stored shape (`(in, out)` for the
    modules in `spec.fan_in_fan_out`); ``full``: every floating tensor of the base under its
    own name (a tied weight is stored once, so it is updated once).
    """
    if carry and adapter != "ffa_lora":
        raise ValueError(f"only ffa_lora updates carry a B for the previous A, not {adapter}")
    if adapter == "full":
        return {
            name: tuple(int(s) for s in t.shape)
            for name, t in state_dict.items()
            if torch.is_floating_point(t)
        }
    shapes = target_weights(state_dict, spec)
    if adapter == "ffa_lora":
        keys = (update_key, carry_key) if carry else (update_key,)
        return {
            key(module): (out, spec.rank) for module, (out, _in) in shapes.items() for key in keys
        }
    return {
        module + ".weight": (in_, out) if module in spec.fan_in_fan_out else (out, in_)
        for module, (out, in_) in shapes.items()
    }
