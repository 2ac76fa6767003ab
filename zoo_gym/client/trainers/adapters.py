"""The adapters a coordinator may ask for besides FFA-LoRA, and `make_trainer`.

Every trainer keeps one model across rounds and shares the SFT loop of
`sft.Trainer`; they differ in what a round trains and what it sends:

- ``lora``: peft LoRA [Hu et al., 2022], A and B both train. A starts from the
  round's seed (`frozen_a`) on every client, B from zero, so all clients start
  equal. Free factors must not be averaged separately (mean(B)·mean(A) is not
  mean(B·A)), so the update is the dense delta ``s·B·A`` `(out, in)` of each
  target weight, keyed by the base weight's name (``"<module>.weight"``).
- ``dora``: DoRA [Liu et al., 2024] (peft ``use_dora=True``): the weight is
  ``m · (W + s·B·A) / ||W + s·B·A||_row`` with a trained magnitude ``m`` `(out,)`.
  The update is that merged weight minus ``W``, so the magnitude is included.
- ``qlora``: QLoRA [Dettmers et al., 2023]: the base is held in 4-bit NF4 by
  bitsandbytes (CUDA or CPU), LoRA trains on top in the compute dtype; the
  update is ``s·B·A`` in float32, the delta against the dequantised base.
- ``full``: every floating weight trains; the update is the dense delta of each
  one. For small models only (`max_full_params`).

All of them run DP-SGD (`sft.DpConfig`) on Opacus's per-record gradients of what they
train: its linear, embedding and norm samplers, functorch for other layers (RMSNorm),
and `dora_magnitude_grad_sample` for the DoRA magnitude.
"""

from __future__ import annotations

import contextlib
import importlib.util
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from opacus.grad_sample.utils import register_grad_sampler
from peft.tuners.lora import LoraLayer
from peft.tuners.lora.dora import DoraLinearLayer
from safetensors import safe_open
from torch import Tensor
from transformers import (
    AutoModelForCausalLM,
    BitsAndBytesConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from zoo_gym.client.device import compute_dtype
from zoo_gym.client.trainers.sft import ADAPTER, FfaLoraTrainer, PeftTrainer, Trainer, _lora
from zoo_gym.core.delta import Delta
from zoo_gym.core.lora import LoraSpec, linear_layers_of, stored, target_weights
from zoo_gym.core.protocol import ADAPTERS
from zoo_gym.core.weights import shard_files

DEFAULT_MAX_FULL_PARAMS = 1_000_000_000


class LoraTrainer(PeftTrainer):
    """Plain LoRA: A and B train; the update is ``s·B·A`` per target weight."""

    adapter = "lora"

    def begin_round(self, seed: int) -> list[torch.nn.Parameter]:
        return self.reset_factors(seed, train_a=True)

    def update(self) -> Delta:
        s = self.spec.scaling
        delta: Delta = {}
        with torch.no_grad():
            for name, layer in sorted(self.layers.items()):
                a = _lora(layer, "lora_A").float()  # (r, in)
                b = _lora(layer, "lora_B").float()  # (out, r)
                delta[name + ".weight"] = stored(s * (b @ a), name, self.oriented).cpu()
        return delta

    def check_dp(self) -> None:
        """Opacus computes per-example gradients of peft's ``lora_A`` / ``lora_B`` linears."""


class DoraTrainer(PeftTrainer):
    """DoRA: A, B and the magnitude train; the update is merged weight minus base weight."""

    adapter = "dora"
    use_dora = True

    def _magnitude(self, name: str) -> torch.nn.Parameter:
        weight = self.layers[name].lora_magnitude_vector[ADAPTER].weight  # (out,)
        assert isinstance(weight, torch.nn.Parameter)
        return weight

    def _base_weight(self, name: str) -> Tensor:
        """The base weight `(out, in)` (a ``Conv1D``'s `(in, out)` transposed, as a view)."""
        weight = self.layers[name].get_base_layer().weight
        assert isinstance(weight, Tensor)
        return weight.T if name in self.oriented.fan_in_fan_out else weight

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._prepare_layers()

    def begin_round(self, seed: int) -> list[torch.nn.Parameter]:
        """A from the seed, B zero, m = the row norms of W: the round starts at the base."""
        params = self.reset_factors(seed, train_a=True)
        with torch.no_grad():
            for name in sorted(self.layers):
                m = self._magnitude(name)
                m.copy_(torch.linalg.norm(self._base_weight(name).float(), dim=1))
                m.requires_grad_(True)
                params.append(m)
        self._clear_caches()
        return params

    def load_base(self, state_dict: dict[str, Tensor]) -> None:
        super().load_base(state_dict)
        self._clear_caches()

    def _clear_caches(self) -> None:
        for layer in self.layers.values():
            dora: Any = layer.lora_magnitude_vector[ADAPTER]
            dora._cache_clear()

    def update(self) -> Delta:
        s = self.spec.scaling
        delta: Delta = {}
        with torch.no_grad():
            for name, layer in sorted(self.layers.items()):
                w = self._base_weight(name).float()  # (out, in)
                a = _lora(layer, "lora_A").float()  # (r, in)
                b = _lora(layer, "lora_B").float()  # (out, r)
                adapted = w + s * (b @ a)
                m = self._magnitude(name).float()  # (out,)
                norm = torch.linalg.norm(adapted, dim=1)  # (out,)
                merged = (m / norm).unsqueeze(1) * adapted
                delta[name + ".weight"] = stored(merged - w, name, self.oriented).cpu()
        return delta

    def check_dp(self) -> None:
        """Opacus's linear sampler gives A's and B's per-record gradients and
        `dora_magnitude_grad_sample` the magnitude's (DoRA's ``lora_weight`` is computed from the
        factors' weights, so ``lora_A`` and ``lora_B`` run forward once per step)."""

    def _prepare_layers(self) -> None:
        """Point each magnitude at its layer (for its per-record gradient) and compute DoRA's
        ``B·A`` from the weights instead of running the factors on an identity matrix."""
        for layer in self.layers.values():
            dora: Any = layer.lora_magnitude_vector[ADAPTER]
            dora.owner = weakref.ref(layer)
            dora.get_lora_weight = _lora_weight


def _lora_weight(lora_A: torch.nn.Linear, lora_B: torch.nn.Linear, **_: Any) -> Tensor:
    """``B·A`` `(out, in)`, what peft's DoRA computes as ``lora_B(lora_A(eye)).T``."""
    return lora_B.weight @ lora_A.weight


def dora_magnitude_grad_sample(
    dora: Any, activations: list[Tensor], backprops: Tensor
) -> dict[torch.nn.Parameter, Tensor]:
    """Per-record gradient `(n, out)` of a DoRA magnitude m, for Opacus's hooks.

    The layer adds ``(m / c - 1) * W x + (m / c) * s * B A x`` to the base output, with the
    row norms ``c = ||W + s B A||_row`` held constant (DoRA, section 4.3), so
    ``dL/dm_j = sum_t g_tj (W x_t + s B A x_t)_j / c_j`` over each record's positions t.
    `activations` is ``[x]`` `(n, ..., in)`, `backprops` is g `(n, ..., out)`.
    """
    owner = dora.owner()
    assert isinstance(owner, LoraLayer)
    x = activations[0]
    base = owner.get_base_layer().weight
    assert isinstance(base, Tensor)
    weight = (base.T if dora.fan_in_fan_out else base).to(x.dtype)  # (out, in)
    scaling: float = owner.scaling[ADAPTER]  # type: ignore[index]
    a, b = _lora(owner, "lora_A"), _lora(owner, "lora_B")  # (r, in), (out, r)
    with torch.no_grad():
        adapted = weight + scaling * (b @ a)  # (out, in)
        norm = torch.linalg.norm(adapted, dim=1)  # (out,)
        directional = x @ adapted.T / norm  # (n, ..., out)
        grad = (backprops * directional).reshape(x.shape[0], -1, weight.shape[0]).sum(1)
    return {dora.weight: grad}


register_grad_sampler(DoraLinearLayer)(dora_magnitude_grad_sample)  # type: ignore[no-untyped-call]


class QLoraTrainer(LoraTrainer):
    """QLoRA: the 4-bit base stays quantised; LoRA trains on top; the update is ``s·B·A``."""

    adapter = "qlora"

    def stored_layers(self, model: PreTrainedModel) -> dict[str, bool]:
        """From the config: quantisation turns a ``Conv1D`` into an `(out, in)` ``Linear4bit``,
        and the checkpoint still stores it `(in, out)`."""
        return linear_layers_of(model.config)

    def load_base(self, state_dict: dict[str, Tensor]) -> None:
        """Copy a new base in: 4-bit weights are quantised again (`(out, in)`), the rest copied."""
        from bitsandbytes.nn.modules import Linear4bit, Params4bit

        targets: dict[str, Tensor] = {}
        quantised: set[str] = set()
        for name, module in self.base.named_modules():
            if isinstance(module, Linear4bit):
                key = name.replace(".base_layer", "") + ".weight"
                quantised.add(key)
                if key not in state_dict:
                    raise ValueError(f"base state dict does not match the model: missing {key}")
                old: Any = module.weight
                weight = state_dict[key].to(torch.float32)
                if key.removesuffix(".weight") in self.oriented.fan_in_fan_out:
                    weight = weight.T
                fresh: Any = Params4bit(  # quantised by `.to(device)`
                    weight.contiguous(),
                    requires_grad=False,
                    blocksize=old.blocksize,
                    compress_statistics=old.compress_statistics,
                    quant_type=old.quant_type,
                    quant_storage=old.quant_storage,
                    module=module,
                )
                module.weight = fresh.to(self.device)
        params = {
            name.replace(".base_layer", ""): p
            for name, p in self.base.named_parameters()
            if ".lora_" not in name
        }
        for key in params:
            if key in quantised:
                continue
            if key not in state_dict:
                raise ValueError(f"base state dict does not match the model: missing {key}")
            targets[key] = state_dict[key]
        with torch.no_grad():
            for key, tensor in targets.items():
                params[key].copy_(tensor.to(params[key].dtype))
        unexpected = sorted(set(state_dict) - set(params) - quantised)
        if unexpected:
            raise ValueError(
                f"base state dict does not match the model: unexpected {unexpected[:3]}"
            )

    def check_dp(self) -> None:
        """Only LoRA's ``lora_A`` / ``lora_B`` linears train; the 4-bit base is frozen and never
        hooked, so Opacus's linear sampler gives every per-record gradient."""


class FullTrainer(Trainer):
    """Full fine-tuning: every floating weight trains; the update is the dense delta of each."""

    adapter = "full"
    model: PreTrainedModel

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        spec: LoraSpec,
        device: str = "cpu",
        gradient_checkpointing: bool = False,
        max_params: int = DEFAULT_MAX_FULL_PARAMS,
    ) -> None:
        super().__init__(
            tokenizer, spec=spec, device=device, gradient_checkpointing=gradient_checkpointing
        )
        check_full_size(sum(p.numel() for p in model.parameters()), max_params)
        model.to(self.device)  # type: ignore[arg-type]
        self._checkpointing(model)
        self.model = model
        self.shapes = target_weights(model, spec)
        self.weights = {
            name: p for name, p in model.named_parameters() if torch.is_floating_point(p)
        }
        self.base_weights = {name: p.detach().clone() for name, p in self.weights.items()}

    def load_base(self, state_dict: dict[str, Tensor]) -> None:
        missing = sorted(set(self.weights) - set(state_dict))
        if missing:
            raise ValueError(f"base state dict does not match the model: missing {missing[:3]}")
        result = self.model.load_state_dict(state_dict, strict=False)
        if result.unexpected_keys:
            raise ValueError(
                f"base state dict does not match the model: unexpected {result.unexpected_keys[:3]}"
            )
        self.base_weights = {name: p.detach().clone() for name, p in self.weights.items()}

    def begin_round(self, seed: int) -> list[torch.nn.Parameter]:
        """Every floating weight, reset to the published base."""
        with torch.no_grad():
            for name, p in self.weights.items():
                p.copy_(self.base_weights[name])
                p.requires_grad_(True)
        return list(self.weights.values())

    def update(self) -> Delta:
        with torch.no_grad():
            return {
                name: (p.float() - self.base_weights[name].float()).cpu()
                for name, p in sorted(self.weights.items())
            }

    @contextlib.contextmanager
    def _swapped(self) -> Iterator[None]:
        with torch.no_grad():
            for name, p in self.weights.items():  # swap storage, no copies
                p.data, self.base_weights[name] = self.base_weights[name], p.data
        try:
            yield
        finally:
            with torch.no_grad():
                for name, p in self.weights.items():
                    p.data, self.base_weights[name] = self.base_weights[name], p.data

    def reference(self) -> contextlib.AbstractContextManager[None]:
        """Context in which `self.model` holds the published base weights (swapped in place)."""
        return self._swapped()

    def check_dp(self) -> None:
        """Opacus's samplers (linear, embedding) and functorch for the rest (RMSNorm) give
        every floating weight a per-record gradient; a tied embedding gets the sum of its two
        uses and counts once in the clipping norm."""


def check_full_size(num_params: int, max_params: int) -> None:
    """Refuse full fine-tuning of a model above `max_params` parameters, in one line."""
    if num_params > max_params:
        raise ValueError(
            f"full fine-tuning is limited to {max_params:,} parameters and this model has "
            f"{num_params:,}; ask the operator for a LoRA adapter or raise max_full_params "
            "in the client config"
        )


def attention_implementation(device: str) -> str:
    """flash-attention 2 on CUDA when `flash_attn` is installed, PyTorch SDPA otherwise."""
    on_cuda = torch.device(device).type == "cuda"
    if on_cuda and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "sdpa"


def _num_params(directory: Path) -> int:
    """Parameter count from the safetensors headers (one file or every shard), without loading
    the weights."""
    total = 0
    for file in shard_files(directory):
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                shape = handle.get_slice(key).get_shape()
                count = 1
                for size in shape:
                    count *= int(size)
                total += count
    return total


PEFT_TRAINERS: dict[str, type[PeftTrainer]] = {
    "ffa_lora": FfaLoraTrainer,
    "lora": LoraTrainer,
    "dora": DoraTrainer,
    "qlora": QLoraTrainer,
}


def make_trainer(
    model_dir_or_model: Path | str | PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    *,
    adapter: str,
    spec: LoraSpec,
    device: str = "cpu",
    gradient_checkpointing: bool = False,
    max_full_params: int = DEFAULT_MAX_FULL_PARAMS,
) -> Trainer:
    """The trainer of `adapter` on a model directory (or an already loaded model).

    Float32 on the CPU; on CUDA the LoRA adapters run a bfloat16 base where the GPU supports it
    (with flash-attention 2 when installed) and `full` stays float32 so small updates are not
    rounded away (`zoo_gym.client.device`).
    """
    if adapter not in ADAPTERS:
        raise ValueError(f"unknown adapter {adapter!r}; the client knows {', '.join(ADAPTERS)}")
    if isinstance(model_dir_or_model, PreTrainedModel):
        if adapter == "qlora":
            raise ValueError(
                "the qlora adapter loads its 4-bit base itself; pass the model directory"
            )
        model = model_dir_or_model
    else:
        model = load_base_model(
            Path(model_dir_or_model),
            adapter=adapter,
            device=device,
            max_full_params=max_full_params,
        )
    if adapter == "full":
        return FullTrainer(
            model,
            tokenizer,
            spec=spec,
            device=device,
            gradient_checkpointing=gradient_checkpointing,
            max_params=max_full_params,
        )
    return PEFT_TRAINERS[adapter](
        model, tokenizer, spec=spec, device=device, gradient_checkpointing=gradient_checkpointing
    )


def load_base_model(
    directory: Path, *, adapter: str, device: str, max_full_params: int
) -> PreTrainedModel:
    """The base model in `directory` as `adapter` trains it (dtypes as in `make_trainer`; 4-bit
    NF4 for qlora); refuses a model too large for full fine-tuning before loading it."""
    dtype = compute_dtype(device, adapter)
    attention = attention_implementation(device) if dtype == torch.bfloat16 else "sdpa"
    if adapter == "full":
        check_full_size(_num_params(directory), max_full_params)
    quantization = None
    if adapter == "qlora":
        quantization = BitsAndBytesConfig(  # type: ignore[no-untyped-call]
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=dtype,
        )
    model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(
        directory,
        dtype=dtype,
        attn_implementation=attention,
        quantization_config=quantization,
        device_map={"": device} if quantization is not None else None,
    )
    return model
