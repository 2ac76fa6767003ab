"""GRPO and GSPO on a contributor's own prompts, one federated round at a time.

One linear program (`train_grpo`) over a few small pure functions. Per step:

1. take `batch_size` prompts and sample `num_generations` completions of each from the
   current policy (the adapter on), under the round's seed;
2. score every completion with the round's reward functions (summed);
3. group-relative advantages: ``A_i = (r_i - mean(r_group)) / (std(r_group) + eps)``;
4. one AdamW step on the clipped surrogate minus ``kl_beta`` times the KL to the
   reference policy, which is the published base: the adapter switched off
   (``trainer.reference()``), so no second copy of the model is held.

GRPO [Shao et al., 2024, DeepSeekMath] clips a per-token ratio
``w_t = pi(o_t | q, o_<t) / pi_old(o_t | q, o_<t)``; GSPO [Zheng et al., 2025] clips one
length-normalised sequence ratio ``s_i = (pi(o_i | q) / pi_old(o_i | q)) ** (1 / |o_i|)``.
The KL is the k3 estimator ``exp(ref - logp) - (ref - logp) - 1`` per token (unbiased, >= 0).
Each step samples afresh, so ``pi_old`` is the sampling policy with its log-probs detached
(the ratio is 1 in value and carries the gradient); ``iterations > 1`` reuses a batch for
several updates, where clipping starts to bind.

Everything runs in float32 on the CPU (no bf16 there). The round's update is whatever the
trainer sends (`trainer.update()`, the B matrices for FFA-LoRA), so it goes through the
same clipping, compression and signing as an SFT update. TRL's ``GRPOTrainer`` implements
the same objective; TRL is not a dependency: this loop needs nothing beyond torch,
transformers and peft.

With DP-SGD (`dp`) the privacy unit is a prompt, one record. Each step takes a Poisson
sample of prompts (CSPRNG-seeded, at the plan's rate) and samples their completions under a
secret seed, so no record's completions depend on which other records were drawn. The loss
is a mean over prompts of each prompt's group loss (the mean over its completions), so a
prompt's gradient is the mean of its completions' per-row gradients (Opacus's hooks give
those); Opacus clips each prompt's gradient to `max_grad_norm` and adds the noise once per
step. The advantages use only the prompt's own group and the KL reference is the published
base on the same completions, so neither carries another record's information.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import secrets
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from opacus import GradSampleModule
from torch import Tensor, nn

from zoo_gym.client.trainers.sft import DpConfig, RoundMeter, RoundResult, StepInfo, poisson_batches
from zoo_gym.core.chat import (
    Prompt,
    completion_mask,
    encode_prompt,
    left_pad,
    pad_id_of,
)
from zoo_gym.core.delta import Delta
from zoo_gym.core.protocol import POLICY_OBJECTIVES, PolicyObjective
from zoo_gym.core.reward_functions import RewardFunction, total_reward
from zoo_gym.privacy.noise import secure_generator

logger = logging.getLogger(__name__)

ADVANTAGE_EPS = 1e-4


class PolicyTrainer(Protocol):
    """What `train_grpo` needs from a trainer (e.g. `FfaLoraTrainer`)."""

    model: Any  # the peft-wrapped module used for forward and generate
    tokenizer: Any
    device: torch.device

    def begin_round(self, seed: int) -> list[nn.Parameter]: ...

    def update(self) -> Delta: ...

    def reference(self) -> contextlib.AbstractContextManager[Any]: ...

    def check_dp(self) -> None: ...

    def grad_sample_module(self) -> GradSampleModule: ...


def group_advantages(rewards: Tensor, num_generations: int, eps: float = ADVANTAGE_EPS) -> Tensor:
    """Group-relative advantages `(n,)` of rewards `(n,)` laid out as `(n / G, G)` groups.

    ``A = (r - mean_group) / (std_group + eps)`` with the sample standard deviation
    (as DeepSeekMath and TRL); a group whose rewards are all equal gets zero advantage.
    """
    grouped = rewards.view(-1, num_generations)  # (b, G)
    mean = grouped.mean(dim=1, keepdim=True)
    std = grouped.std(dim=1, keepdim=True)
    return ((grouped - mean) / (std + eps)).flatten()


def k3_kl(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Per-token KL(pi || ref) estimate ``exp(ref - logp) - (ref - logp) - 1`` [Schulman, 2020]."""
    diff = ref_logp - logp
    return torch.exp(diff) - diff - 1


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    ref_logp: Tensor | None,
    mask: Tensor,
    advantages: Tensor,
    *,
    objective: PolicyObjective,
    clip_epsilon: float,
    kl_beta: float,
) -> tuple[Tensor, Tensor]:
    """The GRPO or GSPO loss `()` and the mean per-token KL `()`.

    `logp`, `old_logp`, `ref_logp` and `mask` are `(n, t)` over completion tokens;
    `advantages` is `(n,)`. With ``|o_i| = sum_t mask``:

    - GRPO: ``-1/n sum_i 1/|o_i| sum_t [min(w_it A_i, clip(w_it, 1 +- eps) A_i) - beta KL_it]``,
      ``w_it = exp(logp_it - old_it)``;
    - GSPO: ``-1/n sum_i [min(s_i A_i, clip(s_i, 1 +- eps) A_i) - beta/|o_i| sum_t KL_it]``,
      ``s_i = exp(1/|o_i| sum_t (logp_it - old_it))``.
    """
    mask = mask.to(logp.dtype)
    lengths = mask.sum(dim=1).clamp(min=1)  # (n,)
    adv = advantages.unsqueeze(1)  # (n, 1)
    if objective == "grpo":
        ratio = torch.exp(logp - old_logp)  # (n, t)
        clipped = ratio.clamp(1 - clip_epsilon, 1 + clip_epsilon)
        surrogate = (torch.minimum(ratio * adv, clipped * adv) * mask).sum(dim=1) / lengths
    elif objective == "gspo":
        log_ratio = ((logp - old_logp) * mask).sum(dim=1) / lengths  # (n,)
        ratio = torch.exp(log_ratio)
        clipped = ratio.clamp(1 - clip_epsilon, 1 + clip_epsilon)
        surrogate = torch.minimum(ratio * advantages, clipped * advantages)
    else:
        raise ValueError(
            f"objective must be one of {', '.join(POLICY_OBJECTIVES)}, not {objective!r}"
        )
    kl = torch.zeros_like(lengths)
    if ref_logp is not None:
        kl = (k3_kl(logp, ref_logp) * mask).sum(dim=1) / lengths  # (n,)
    loss = -(surrogate - kl_beta * kl).mean()
    return loss, kl.mean()  # zeros without a reference


def token_logprobs(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    prompt_length: int,
    temperature: float,
) -> Tensor:
    """Log-probs `(n, c)` of the completion tokens ``input_ids[:, prompt_length:]``.

    Rows are left-padded prompts followed by completions; positions count real
    tokens only, as in generation. Logits are divided by `temperature`, so these are
    the log-probs of the distribution the completions were sampled from.
    """
    position_ids = (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)
    logits = model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids
    ).logits  # (n, L, V)
    logits = logits[:, prompt_length - 1 : -1].float() / temperature  # (n, c, V)
    targets = input_ids[:, prompt_length:]  # (n, c)
    return torch.log_softmax(logits, dim=-1).gather(2, targets.unsqueeze(2)).squeeze(2)


def step_seed(seed: int, step: int) -> int:
    """The sampling seed of one step of a round, the same on every machine."""
    digest = hashlib.sha256(f"zoo-gym/grpo-sampling/{seed}/{step}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def prompt_batches(n: int, batch_size: int, generator: torch.Generator) -> Iterator[list[int]]:
    """Endless batches of prompt indices: epochs of random permutations, cut into batches."""
    while True:
        order = torch.randperm(n, generator=generator).tolist()
        for start in range(0, n, batch_size):
            yield order[start : start + batch_size]


def train_grpo(
    trainer: PolicyTrainer,
    prompts: Sequence[Prompt],
    *,
    objective: str,
    seed: int,
    steps: int,
    lr: float,
    batch_size: int,
    num_generations: int,
    max_new_tokens: int,
    temperature: float,
    clip_epsilon: float,
    kl_beta: float,
    rewards: Mapping[str, RewardFunction],
    max_length: int,
    on_step: Callable[[StepInfo], None] | None = None,
    iterations: int = 1,
    a_seed: int | None = None,
    dp: DpConfig | None = None,
) -> RoundResult:
    """`steps` GRPO or GSPO steps of what `trainer.begin_round(a_seed)` returns (the frozen
    LoRA A's seed; default `seed`, which draws prompts and samples).

    `prompts` are (conversation, answer) pairs (`prompts_from_conversations`); each
    step uses `batch_size` of them with `num_generations` completions each, so
    ``batch_size * num_generations`` sequences. Prompts are cut on the left to leave
    `max_new_tokens` within `max_length`. Deterministic under `seed` on one device without
    `dp`; with `dp` (DP-SGD per prompt, see above) the batches, samples and noise are secret.
    """
    _check_policy_round(objective, prompts, num_generations, rewards, iterations, trainer, dp)
    meter, room = RoundMeter(steps, on_step, rewards=[]), max(1, max_length - max_new_tokens)
    prompt_ids = [encode_prompt(trainer.tokenizer, c)[-room:] for c, _ in prompts]
    policy = _Policy(trainer, temperature=temperature, max_new_tokens=max_new_tokens)
    params = trainer.begin_round(seed if a_seed is None else a_seed)
    plan = _plan_steps(trainer, params, lr, seed, batch_size, len(prompts), dp)
    mode: PolicyObjective = "gspo" if objective == "gspo" else "grpo"
    optimise = _PolicyStep(
        policy, plan.optimizer, mode, clip_epsilon, kl_beta, iterations, num_generations, bool(dp)
    )
    try:
        for step in range(1, steps + 1):
            # 1. sample each prompt num_generations times, 2. reward, 3. advantages, 4. update
            rows = [i for i in next(plan.batches) for _ in range(num_generations)]
            if not rows:  # an empty Poisson batch still takes a (pure-noise) step
                optimise.noise_only(params)
                meter.step(step, loss=None, tokens=0)
                continue
            sampling = step_seed(seed, step) if dp is None else secrets.randbits(63)
            rollout = policy.sample([prompt_ids[i] for i in rows], seed=sampling)
            scores = policy.score(rollout, [prompts[i][1] for i in rows], rewards)  # (n,)
            advantages = group_advantages(scores, num_generations).to(trainer.device)  # (n,)
            loss, kl = optimise(rollout, advantages)
            reward = float(scores.mean())
            logger.debug("step %d: loss %.4f, reward %.3f, kl %.5f", step, loss, reward, kl)
            meter.step(step, loss=loss, tokens=int(rollout.attention.sum()), reward=reward)
    finally:
        if plan.hooks is not None:
            plan.hooks._close()
    return _finish(trainer, meter, objective, len(prompts), plan.sample_rate)


def _finish(
    trainer: PolicyTrainer,
    meter: RoundMeter,
    objective: str,
    records: int,
    sample_rate: float | None,
) -> RoundResult:
    """The round's update and meters, logged."""
    trainer.model.eval()
    meter.stop()
    result = meter.result(trainer.update(), num_examples=records, sample_rate=sample_rate)
    logger.info(
        "%s round trained: %d steps, mean reward %.3f, %.1fs",
        objective,
        meter.steps,
        result.mean_reward,
        result.seconds,
    )
    return result


@dataclass
class _StepPlan:
    """How a round's steps draw prompts and update: plain AdamW on shuffled batches, or under
    DP-SGD Poisson batches at the plan's rate, a noisy clipping optimiser and Opacus hooks."""

    optimizer: torch.optim.Optimizer
    batches: Iterator[list[int]]
    sample_rate: float | None = None
    hooks: GradSampleModule | None = None


def _plan_steps(
    trainer: PolicyTrainer,
    params: list[nn.Parameter],
    lr: float,
    seed: int,
    batch_size: int,
    records: int,
    dp: DpConfig | None,
) -> _StepPlan:
    optimizer: torch.optim.Optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    if dp is None:
        return _StepPlan(
            optimizer, prompt_batches(records, batch_size, torch.Generator().manual_seed(seed))
        )
    sample_rate = dp.rate(batch_size, records)
    expected = min(batch_size, round(sample_rate * records))
    return _StepPlan(
        dp.optimizer(optimizer, expected_batch_size=expected),
        poisson_batches(records, sample_rate, secure_generator()),
        sample_rate,
        trainer.grad_sample_module(),  # after begin_round: what requires grad
    )


def _check_policy_round(
    objective: str,
    prompts: Sequence[Prompt],
    num_generations: int,
    rewards: Mapping[str, RewardFunction],
    iterations: int,
    trainer: PolicyTrainer,
    dp: DpConfig | None,
) -> None:
    """Raise ValueError on arguments no GRPO / GSPO round can run with."""
    if objective not in POLICY_OBJECTIVES:
        raise ValueError(
            f"objective must be one of {', '.join(POLICY_OBJECTIVES)}, not {objective!r}"
        )
    if not prompts:
        raise ValueError("GRPO needs at least one prompt (a conversation ending in an answer)")
    if num_generations < 2:
        raise ValueError("num_generations must be at least 2 (advantages are relative to a group)")
    if not rewards:
        raise ValueError("GRPO needs at least one reward function")
    if iterations < 1:
        raise ValueError("iterations must be at least 1")
    if dp is not None:
        trainer.check_dp()
        if iterations != 1:
            raise ValueError("DP-SGD takes one step per sampled batch; set iterations to 1")


@dataclass(frozen=True)
class Rollout:
    """One step's sampled sequences: left-padded prompts `(n, p)` followed by completions `(n, c)`."""

    sequences: Tensor  # (n, p + c)
    prompt_length: int  # p
    mask: Tensor  # (n, c): completion tokens up to and including the first EOS
    attention: Tensor  # (n, p + c): real prompt tokens and `mask`

    @property
    def completions(self) -> Tensor:
        return self.sequences[:, self.prompt_length :]  # (n, c)


@dataclass(frozen=True)
class _Policy:
    """The trainer's model as the sampling policy: completions, their rewards, their log-probs."""

    trainer: PolicyTrainer
    temperature: float
    max_new_tokens: int

    @property
    def pad_id(self) -> int:
        return pad_id_of(self.trainer.tokenizer)

    @property
    def eos_id(self) -> int:
        eos_id = self.trainer.tokenizer.eos_token_id
        return eos_id if eos_id is not None else self.pad_id

    def sample(self, prompt_ids: Sequence[list[int]], *, seed: int) -> Rollout:
        """One completion of each prompt, the adapter on, drawn under `seed` (the global RNG
        state is left as it was)."""
        device, model = self.trainer.device, self.trainer.model
        ids, prompt_mask = left_pad(prompt_ids, self.pad_id)
        ids, prompt_mask = ids.to(device), prompt_mask.to(device)
        model.eval()
        with (
            torch.no_grad(),
            torch.random.fork_rng(devices=[device] if device.type == "cuda" else []),
        ):
            torch.manual_seed(seed)
            sequences = model.generate(
                input_ids=ids,
                attention_mask=prompt_mask,
                do_sample=True,
                temperature=self.temperature,
                top_k=0,
                top_p=1.0,
                max_new_tokens=self.max_new_tokens,
                pad_token_id=self.pad_id,
                eos_token_id=self.eos_id,
            )  # (n, p + c)
        width = ids.shape[1]
        mask = completion_mask(sequences[:, width:], self.eos_id)  # (n, c)
        attention = torch.cat([prompt_mask, mask.long()], dim=1)  # (n, p + c)
        return Rollout(sequences, width, mask, attention)

    def score(
        self, rollout: Rollout, answers: Sequence[str], rewards: Mapping[str, RewardFunction]
    ) -> Tensor:
        """The summed reward `(n,)` of each completion against its prompt's answer."""
        texts = [
            self.trainer.tokenizer.decode(row[m].tolist(), skip_special_tokens=True)
            for row, m in zip(rollout.completions, rollout.mask, strict=True)
        ]
        return torch.tensor(
            [
                total_reward(rewards, text, answer)
                for text, answer in zip(texts, answers, strict=True)
            ],
            dtype=torch.float32,
        )

    def logprobs(self, rollout: Rollout) -> Tensor:
        """Log-probs `(n, c)` of the completions under the model as it is now."""
        return token_logprobs(
            self.trainer.model,
            rollout.sequences,
            rollout.attention,
            rollout.prompt_length,
            self.temperature,
        )


@dataclass(frozen=True)
class _PolicyStep:
    """One optimisation step of `policy` on a rollout: `iterations` AdamW updates of the loss."""

    policy: _Policy
    optimizer: torch.optim.Optimizer
    objective: PolicyObjective
    clip_epsilon: float
    kl_beta: float
    iterations: int
    num_generations: int = 1
    per_prompt: bool = False  # DP-SGD: hand Opacus one gradient per prompt, not per row

    def __call__(self, rollout: Rollout, advantages: Tensor) -> tuple[float, float]:
        """(the last loss, its mean per-token KL to the reference)."""
        policy = self.policy
        with torch.no_grad():  # the sampling policy (pi_old) and the reference (adapter off)
            old_logp = policy.logprobs(rollout)
            ref_logp = None
            if self.kl_beta > 0:
                with policy.trainer.reference():
                    ref_logp = policy.logprobs(rollout)
        policy.trainer.model.train()
        for _ in range(self.iterations):
            loss, kl = policy_loss(
                policy.logprobs(rollout),
                old_logp,
                ref_logp,
                rollout.mask,
                advantages,
                objective=self.objective,
                clip_epsilon=self.clip_epsilon,
                kl_beta=self.kl_beta,
            )
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()  # type: ignore[no-untyped-call]
            if self.per_prompt:
                self._group_grad_samples()
            self.optimizer.step()
        return loss.item(), kl.item()

    def _group_grad_samples(self) -> None:
        """Turn Opacus's per-row gradients `(b * G, ...)` into per-prompt ones `(b, ...)`: the
        loss is the mean over prompts of each group's mean loss, and rows of a prompt are
        adjacent, so a prompt's gradient is the mean of its G rows' gradients."""
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                rows = getattr(p, "grad_sample", None)
                if isinstance(rows, Tensor):
                    grouped = rows.view(-1, self.num_generations, *rows.shape[1:])
                    p.grad_sample = grouped.mean(dim=1)

    def noise_only(self, params: Sequence[nn.Parameter]) -> None:
        """A step on an empty Poisson batch: no record, only the optimizer's noise."""
        self.optimizer.zero_grad(set_to_none=True)
        for p in params:
            p.grad_sample = torch.zeros((0, *p.shape), device=p.device)  # type: ignore[attr-defined]
        self.optimizer.step()
