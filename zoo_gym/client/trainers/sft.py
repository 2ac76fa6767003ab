"""Supervised fine-tuning, one federated round at a time, and the FFA-LoRA trainer.

`Trainer.train_round` is one linear program shared by every adapter: the
model is loaded once and kept between rounds; each round (1) `begin_round`
resets the adapter from the round's seed and names what trains, (2) AdamW (or
Opacus DP-SGD) trains it on the completion-token loss, (3) `update` returns what
the round sends. Sequences are batched by length (`length_bucketed_batches`),
not packed: packing several conversations into one row would need a per-document
attention mask to keep the completion loss exact.

`FfaLoraTrainer` (the default) writes the round's frozen A matrices (`frozen_a`,
shared by every client), zeroes every B, trains only B and sends the B matrices.
See FFA-LoRA [Sun et al., 2024] and LoRA [Hu et al., 2022]. The other adapters
(plain LoRA, DoRA, QLoRA, full fine-tuning) are in `adapters.py`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from opacus import GradSampleModule
from opacus.optimizers import DPOptimizer
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from zoo_gym.core.chat import Conversation, collate, encode_conversation, pad_id_of, token_nll
from zoo_gym.core.delta import Delta
from zoo_gym.core.lora import (
    LoraSpec,
    for_base,
    frozen_a,
    linear_layers,
    target_weights,
    update_key,
)
from zoo_gym.privacy.noise import secure_generator

logger = logging.getLogger(__name__)

ADAPTER = "default"


@dataclass(frozen=True)
class DpConfig:
    """DP-SGD [Abadi et al., 2016] on every trainable parameter, through Opacus.

    Each step samples every record independently with probability `sample_rate`
    (default ``batch_size / records``; Poisson sampling, which the accountants assume, drawn
    from a CSPRNG-seeded generator so the public round seed does not reveal it),
    clips each record's gradient (all trainable parameters jointly) to `max_grad_norm` and
    adds Gaussian noise of std ``noise_multiplier * max_grad_norm`` from a CSPRNG-seeded
    generator. Account with ``zoo_gym.privacy.accounting.epsilon(noise_multiplier,
    RoundResult.sample_rate, steps, delta)``.
    """

    max_grad_norm: float = 1.0
    noise_multiplier: float = 1.0
    sample_rate: float | None = None  # the rate the privacy plan charges; None: batch / records

    def rate(self, batch_size: int, records: int) -> float:
        """The Poisson rate of a round over `records` with batches of `batch_size` expected."""
        return self.sample_rate if self.sample_rate is not None else min(1.0, batch_size / records)

    def optimizer(
        self, optimizer: torch.optim.Optimizer, *, expected_batch_size: int
    ) -> DPOptimizer:
        """`optimizer` behind Opacus's per-record clipping and CSPRNG-seeded Gaussian noise,
        for a loss that is the mean over records of the batch."""
        return DPOptimizer(
            optimizer,
            noise_multiplier=self.noise_multiplier,
            max_grad_norm=self.max_grad_norm,
            expected_batch_size=max(1, expected_batch_size),
            loss_reduction="mean",
            generator=secure_generator(),
        )


@dataclass(frozen=True)
class StepInfo:
    """Progress of one optimisation step."""

    step: int
    steps: int
    loss: float
    tokens_per_s: float
    reward: float | None = None  # mean reward of the step's completions (GRPO / GSPO)


@dataclass(frozen=True)
class RoundResult:
    """What one round produced: ``update`` is the trainer's `update()` (float32, on the CPU):
    ``"<module>.lora_B"`` `(out, rank)` for FFA-LoRA, base weight names for dense adapters."""

    update: Delta
    num_examples: int
    mean_loss: float
    tokens: int
    seconds: float
    sample_rate: float | None = None  # Poisson rate under DP-SGD, else None
    mean_reward: float | None = None  # GRPO / GSPO: mean reward over the round's completions


@dataclass
class RoundMeter:
    """A round's losses, tokens and (policy objectives) rewards so far; tells `on_step` each step.

    `rewards` is None for objectives without a reward (SFT), a list of per-step means otherwise.
    """

    steps: int
    on_step: Callable[[StepInfo], None] | None = None
    rewards: list[float] | None = None
    losses: list[float] = field(default_factory=list)
    tokens: int = 0
    start: float = field(default_factory=time.perf_counter)
    seconds: float = 0.0  # set by `stop`

    def step(
        self, step: int, *, loss: float | None, tokens: int, reward: float | None = None
    ) -> None:
        """Record a step (`loss` None: an empty batch) and report it with the last loss so far."""
        if loss is not None:
            self.losses.append(loss)
        if reward is not None:
            assert self.rewards is not None
            self.rewards.append(reward)
        self.tokens += tokens
        if self.on_step is not None:
            rate = self.tokens / max(time.perf_counter() - self.start, 1e-9)
            last = self.losses[-1] if self.losses else float("nan")
            self.on_step(
                StepInfo(step=step, steps=self.steps, loss=last, tokens_per_s=rate, reward=reward)
            )

    def stop(self) -> None:
        """The round's training is over: fix its duration."""
        self.seconds = time.perf_counter() - self.start

    def result(
        self, update: Delta, *, num_examples: int, sample_rate: float | None = None
    ) -> RoundResult:
        """What the round produced, `update` being the trainer's `update()`."""
        return RoundResult(
            update=update,
            num_examples=num_examples,
            mean_loss=mean_or_nan(self.losses),
            tokens=self.tokens,
            seconds=self.seconds,
            sample_rate=sample_rate,
            mean_reward=None if self.rewards is None else mean_or_nan(self.rewards),
        )


@dataclass
class _RoundLoop:
    """How a round's steps run: the rows each step takes, the module run forward, the optimizer."""

    batches: Iterator[list[int]]
    forward: torch.nn.Module
    optimizer: torch.optim.Optimizer
    sample_rate: float | None = None  # Poisson rate under DP-SGD

    def close(self) -> None:
        """Take Opacus's hooks off the model again."""
        if isinstance(self.forward, GradSampleModule):
            self.forward._close()


class Trainer:
    """One model kept across rounds, and the SFT loop every adapter shares.

    A subclass sets `model` (the module to run forward on), `shapes` (target module ->
    weight shape `(out, in)`, whatever the orientation it is stored in) and implements
    `load_base`, `begin_round`, `update` and `reference`.
    """

    adapter = ""
    model: PeftModel | PreTrainedModel
    shapes: dict[str, tuple[int, int]]

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        *,
        spec: LoraSpec,
        device: str = "cpu",
        gradient_checkpointing: bool = False,
    ) -> None:
        self.spec = spec
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self.gradient_checkpointing = gradient_checkpointing

    def _checkpointing(self, model: PreTrainedModel) -> None:
        """Recompute activations in backward (non-reentrant: frozen inputs need no grad)."""
        if self.gradient_checkpointing:
            kwargs = {"use_reentrant": False}
            enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5
            if enable is not None:
                enable(activation_checkpointing_kwargs=kwargs)
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)  # type: ignore[no-untyped-call]
            model.config.use_cache = False

    def load_base(self, state_dict: dict[str, Tensor]) -> None:
        """Copy a new published base version into the model, in place."""
        raise NotImplementedError

    def begin_round(self, seed: int) -> list[torch.nn.Parameter]:
        """Start a round from the published base; return the parameters the round trains."""
        raise NotImplementedError

    def update(self) -> Delta:
        """What this round sends, float32 on the CPU."""
        raise NotImplementedError

    def reference(self) -> contextlib.AbstractContextManager[None]:
        """Context in which `self.model` computes the base model (adapter off)."""
        raise NotImplementedError

    def check_dp(self) -> None:
        """Raise if DP-SGD cannot run on this adapter's trainable parameters."""

    def train_round(
        self,
        conversations: Sequence[Conversation],
        *,
        seed: int,
        steps: int,
        lr: float,
        batch_size: int,
        max_length: int,
        on_step: Callable[[StepInfo], None] | None = None,
        dp: DpConfig | None = None,
        a_seed: int | None = None,
    ) -> RoundResult:
        """Train what `begin_round` returns for `steps` AdamW steps on `conversations`.

        `seed` draws the batches, `a_seed` (default: `seed`) the frozen LoRA A.
        Deterministic under both without `dp`; with `dp` the noise is secret.
        """
        if not conversations:
            raise ValueError("train_round needs at least one conversation")
        if dp is not None:
            self.check_dp()
        meter = RoundMeter(steps, on_step)
        examples = [
            encode_conversation(self.tokenizer, c, max_length=max_length) for c in conversations
        ]
        params = self.begin_round(seed if a_seed is None else a_seed)
        loop = self._round_loop(examples, params, seed=seed, lr=lr, batch_size=batch_size, dp=dp)
        pad_id = pad_id_of(self.tokenizer)
        self.model.train()
        try:
            for step in range(1, steps + 1):
                rows = next(loop.batches)
                loop.optimizer.zero_grad(set_to_none=True)
                loss, tokens = self._backward(
                    loop.forward, [examples[i] for i in rows], params, pad_id, dp=dp is not None
                )
                loop.optimizer.step()
                meter.step(step, loss=loss, tokens=tokens)
        finally:
            loop.close()
        self.model.eval()
        meter.stop()
        result = meter.result(
            self.update(), num_examples=len(conversations), sample_rate=loop.sample_rate
        )
        logger.info(
            "round trained: %d steps, mean loss %.4f, %.1fs", steps, result.mean_loss, meter.seconds
        )
        return result

    def _round_loop(
        self,
        examples: Sequence[tuple[list[int], list[int]]],
        params: list[torch.nn.Parameter],
        *,
        seed: int,
        lr: float,
        batch_size: int,
        dp: DpConfig | None,
    ) -> _RoundLoop:
        """AdamW on length-bucketed batches drawn under `seed`, or with `dp` Opacus DP-SGD on
        Poisson batches drawn in secret (the accountants assume nobody knows which records each
        step used, and the round seed is public)."""
        optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
        if dp is None:
            lengths = [len(ids) for ids, _ in examples]
            generator = torch.Generator().manual_seed(seed)
            return _RoundLoop(
                length_bucketed_batches(lengths, batch_size, generator), self.model, optimizer
            )
        sample_rate = dp.rate(batch_size, len(examples))
        return _RoundLoop(  # hooks go on after begin_round: only parameters that require grad
            batches=poisson_batches(len(examples), sample_rate, secure_generator()),
            forward=self.grad_sample_module(),
            optimizer=dp.optimizer(optimizer, expected_batch_size=batch_size),
            sample_rate=sample_rate,
        )

    def grad_sample_module(self) -> GradSampleModule:
        """Opacus's per-record gradient hooks on every parameter that requires grad (call after
        `begin_round`): its own samplers for linear, embedding and norm layers, functorch for
        other layers (e.g. ``LlamaRMSNorm``), and what `adapters` registers (the DoRA
        magnitude). A weight used twice (tied embeddings) gets the sum of both uses."""
        return GradSampleModule(self.model, loss_reduction="mean")

    def _backward(
        self,
        forward: torch.nn.Module,
        examples: Sequence[tuple[list[int], list[int]]],
        params: list[torch.nn.Parameter],
        pad_id: int,
        *,
        dp: bool,
    ) -> tuple[float | None, int]:
        """Backpropagate the completion loss of `examples`: (loss, tokens), loss None when the
        batch is empty."""
        if not examples:  # an empty Poisson batch still takes a (pure-noise) step
            for p in params:
                p.grad_sample = torch.zeros((0, *p.shape), device=p.device)  # type: ignore[attr-defined]
            return None, 0
        batch = collate(examples, pad_id=pad_id).to(self.device)
        nll, mask = token_nll(forward, batch)
        if dp:  # mean of per-example token means, so each example is one term
            loss = (nll.sum(1) / mask.sum(1).clamp(min=1)).mean()
        else:  # token mean over the batch
            loss = nll.sum() / mask.sum().clamp(min=1)
        loss.backward()  # type: ignore[no-untyped-call]
        return loss.item(), batch.num_tokens


class PeftTrainer(Trainer):
    """A base model wrapped once with a peft LoRA adapter on the spec's target modules.

    ``Conv1D`` layers (GPT-2) store their weight `(in, out)`: peft adapts them with
    ``fan_in_fan_out``, its A is `(r, in)` and its B `(out, r)` as for ``nn.Linear``, and
    `oriented` (the spec with the base's orientation) turns a delta `(out, in)` into the
    weight's stored shape.
    """

    model: PeftModel
    use_dora = False  # DoRA's magnitude vectors beside the LoRA factors

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        spec: LoraSpec,
        device: str = "cpu",
        gradient_checkpointing: bool = False,
    ) -> None:
        super().__init__(
            tokenizer, spec=spec, device=device, gradient_checkpointing=gradient_checkpointing
        )
        linear = linear_layers(model)
        self.oriented = for_base(spec, self.stored_layers(model), adapter=self.adapter)
        self.shapes = target_weights(model, spec)
        config = LoraConfig(
            r=spec.rank,
            lora_alpha=spec.alpha,  # type: ignore[arg-type]
            target_modules=list(spec.target_modules),
            lora_dropout=0.0,
            bias="none",
            use_dora=self.use_dora,
            fan_in_fan_out=any(linear.get(name, False) for name in self.shapes),
        )
        if not getattr(model, "is_loaded_in_4bit", False):
            model.to(self.device)  # type: ignore[arg-type]
        self._checkpointing(model)
        self.base = model
        self.model = get_peft_model(model, config)  # wraps `model` in place
        self.layers: dict[str, LoraLayer] = {
            name: module
            for name, module in self.base.named_modules()
            if isinstance(module, LoraLayer)
        }
        if set(self.layers) != set(self.shapes):
            raise RuntimeError("peft adapted a different set of modules than target_weights found")

    def stored_layers(self, model: PreTrainedModel) -> dict[str, bool]:
        """The linear layers of `model` and whether the checkpoint stores them `(in, out)`."""
        return linear_layers(model)

    def load_base(self, state_dict: dict[str, Tensor]) -> None:
        mapped = {}
        for key, tensor in state_dict.items():
            module, _, leaf = key.rpartition(".")
            mapped[f"{module}.base_layer.{leaf}" if module in self.layers else key] = tensor
        result = self.base.load_state_dict(mapped, strict=False)
        missing = [key for key in result.missing_keys if ".lora_" not in key]
        if result.unexpected_keys or missing:
            raise ValueError(
                f"base state dict does not match the model: missing {missing[:3]}, "
                f"unexpected {result.unexpected_keys[:3]}"
            )

    def reference(self) -> contextlib.AbstractContextManager[None]:
        """Context in which `self.model` computes the base model (adapter off): a KL reference
        without a second copy of the weights."""
        return self.model.disable_adapter()

    def reset_factors(self, seed: int, *, train_a: bool) -> list[torch.nn.Parameter]:
        """Set every A to the round's A (`frozen_a`, the same on every client) and every B to
        zero; return the B parameters, preceded by the A's when `train_a`."""
        a_params, b_params = [], []
        with torch.no_grad():
            for name, layer in sorted(self.layers.items()):
                a = _lora(layer, "lora_A")  # (r, in)
                a.copy_(frozen_a(seed, name, a.shape[1], self.spec.rank))
                a.requires_grad_(train_a)
                a_params.append(a)
                b = _lora(layer, "lora_B")  # (out, r)
                b.zero_()
                b.requires_grad_(True)
                b_params.append(b)
        return a_params + b_params if train_a else b_params


class FfaLoraTrainer(PeftTrainer):
    """FFA-LoRA: A frozen from the round's seed, only B trains; the update is the B matrices."""

    adapter = "ffa_lora"

    def adapter_b(self) -> Delta:
        """The current B matrices, keyed like an update."""
        return {
            update_key(name): _lora(layer, "lora_B").detach().float().cpu().clone()
            for name, layer in sorted(self.layers.items())
        }

    def begin_round(self, seed: int) -> list[torch.nn.Parameter]:
        return self.reset_adapters(seed)

    def update(self) -> Delta:
        """What this round sends (here the B matrices)."""
        return self.adapter_b()

    def reset_adapters(self, seed: int) -> list[torch.nn.Parameter]:
        """Set every A to the round's frozen A and every B to zero; return the B parameters."""
        return self.reset_factors(seed, train_a=False)


def length_bucketed_batches(
    lengths: Sequence[int], batch_size: int, generator: torch.Generator, *, pool: int = 16
) -> Iterator[list[int]]:
    """Endless batches of indices: shuffle, sort within pools of ``pool * batch_size`` by length,
    cut into batches, shuffle the batches. Less padding, still random."""
    while True:
        order = torch.randperm(len(lengths), generator=generator).tolist()
        batches: list[list[int]] = []
        for s in range(0, len(order), pool * batch_size):
            chunk = sorted(order[s : s + pool * batch_size], key=lambda i: lengths[i])
            batches += [chunk[j : j + batch_size] for j in range(0, len(chunk), batch_size)]
        for k in torch.randperm(len(batches), generator=generator).tolist():
            yield batches[k]


def poisson_batches(n: int, rate: float, generator: torch.Generator) -> Iterator[list[int]]:
    """Endless Poisson-sampled batches: each of `n` indices is in a batch with probability `rate`."""
    while True:
        yield torch.nonzero(torch.rand(n, generator=generator) < rate).flatten().tolist()


def _lora(layer: LoraLayer, which: str) -> torch.nn.Parameter:
    """The weight of `layer`'s ``lora_A`` `(r, in)` or ``lora_B`` `(out, r)` for our adapter."""
    weight = getattr(layer, which)[ADAPTER].weight
    assert isinstance(weight, torch.nn.Parameter)
    return weight


def mean_or_nan(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("nan")
