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

The other adapters (plain LoRA, DoRA, QLoRA, full fine-tuning) send dense weight
deltas keyed by base weight names; `update_shapes` says what an update of each
adapter consists of and `merge_update` merges either kind (`merge_ffa`,
`merge_dense`).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from zoo_gym.core.delta import Delta
from zoo_gym.core.protocol import DEFAULT_TARGETS

_B_SUFFIX = ".lora_B"


@dataclass(frozen=True)
class LoraSpec:
    """Which linear layers get an adapter, its rank and its scale ``alpha / rank``."""

    rank: int = 8
    alpha: float = 16.0
    target_modules: tuple[str, ...] = DEFAULT_TARGETS

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


def target_weights(
    model_or_state_dict: nn.Module | Mapping[str, Tensor], spec: LoraSpec
) -> dict[str, tuple[int, int]]:
    """Target modules of a base model (or its state dict) and their weight shape `(out, in)`."""
    state = (
        model_or_state_dict.state_dict()
        if isinstance(model_or_state_dict, nn.Module)
        else model_or_state_dict
    )
    targets: dict[str, tuple[int, int]] = {}
    for key, tensor in state.items():
        module, _, leaf = key.rpartition(".")
        if leaf == "weight" and module.rpartition(".")[2] in spec.target_modules:
            if tensor.dim() != 2:
                raise ValueError(f"{key}: target weight must be 2-D, got {tuple(tensor.shape)}")
            targets[module] = (int(tensor.shape[0]), int(tensor.shape[1]))
    return targets


def update_key(module_name: str) -> str:
    """Key of a module's B matrix in an update: ``"<module>.lora_B"``."""
    return module_name + _B_SUFFIX


def module_of(key: str) -> str:
    """Inverse of `update_key`."""
    if not key.endswith(_B_SUFFIX):
        raise ValueError(f"{key!r} is not an FFA-LoRA update key (expected '<module>.lora_B')")
    return key.removesuffix(_B_SUFFIX)


def dense_delta(
    update: Delta, *, spec: LoraSpec, seed: int, shapes: Mapping[str, tuple[int, int]]
) -> Delta:
    """Map each ``"<module>.lora_B"`` `(out, r)` to ``"<module>.weight"`` = scaling * B @ A.

    `shapes` gives each module's weight shape `(out, in)` (see `target_weights`);
    A's width is ``in``. The result is float32 on the CPU.
    """
    dense: Delta = {}
    for key, b in update.items():
        module = module_of(key)
        if module not in shapes:
            raise ValueError(f"{key}: {module!r} is not a target module of the base model")
        out_features, in_features = shapes[module]
        if tuple(b.shape) != (out_features, spec.rank):
            raise ValueError(
                f"{key}: shape {tuple(b.shape)}, expected ({out_features}, {spec.rank})"
            )
        a = frozen_a(seed, module, in_features, spec.rank)  # (r, in)
        dense[module + ".weight"] = spec.scaling * (b.detach().float().cpu() @ a)  # (out, in)
    return dense


def merge_ffa(state_dict: dict[str, Tensor], update: Delta, *, spec: LoraSpec, seed: int) -> None:
    """Add ``scaling * B @ A`` of every module in `update` to `state_dict`, in place.

    The sum is formed in float32 and written back in each weight's own dtype.
    """
    shapes: dict[str, tuple[int, int]] = {}
    for key in update:
        weight = state_dict.get(module_of(key) + ".weight")
        if weight is not None and weight.dim() == 2:
            shapes[module_of(key)] = (int(weight.shape[0]), int(weight.shape[1]))
    dense = dense_delta(update, spec=spec, seed=seed, shapes=shapes)
    with torch.no_grad():
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
    state_dict: dict[str, Tensor], update: Delta, *, adapter: str, spec: LoraSpec, seed: int
) -> None:
    """Merge one (aggregated) update of `adapter` into `state_dict`, in place.

    ``ffa_lora``: ``W += scaling * B @ A`` (`merge_ffa`); every other adapter sends
    dense deltas keyed by weight name: ``W += delta`` (`merge_dense`).
    """
    if adapter == "ffa_lora":
        merge_ffa(state_dict, update, spec=spec, seed=seed)
    else:
        merge_dense(state_dict, update)


def update_shapes(
    state_dict: Mapping[str, Tensor], *, adapter: str, spec: LoraSpec
) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor an update of `adapter` consists of, for this base.

    ``ffa_lora``: ``"<module>.lora_B"`` `(out, rank)`; ``lora`` / ``dora`` / ``qlora``:
    ``"<module>.weight"`` `(out, in)` of each target module; ``full``: every floating
    tensor of the base under its own name.
    """
    if adapter == "full":
        return {
            name: tuple(int(s) for s in t.shape)
            for name, t in state_dict.items()
            if torch.is_floating_point(t)
        }
    shapes = target_weights(state_dict, spec)
    if adapter == "ffa_lora":
        return {update_key(module): (out, spec.rank) for module, (out, _in) in shapes.items()}
    return {module + ".weight": (out, in_) for module, (out, in_) in shapes.items()}
