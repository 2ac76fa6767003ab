"""GRPO and GSPO on a contributor's own prompts, one federated round at a time.

One long, linear program (`train_grpo`) over a few small pure functions. Per step:

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
same clipping, compression and signing as an SFT update. There is no DP-SGD variant:
per-example DP-SGD applies to SFT on the contributor's records; update-level clipping and
Gaussian noise still apply to this update after the round. TRL's ``GRPOTrainer`` implements
the same objective; TRL is not a dependency: this loop needs nothing beyond torch,
transformers and peft.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from zoo_gym.client.trainers.sft import RoundResult, StepInfo, mean_or_nan
from zoo_gym.core.chat import (
    Prompt,
    completion_mask,
    encode_prompt,
    left_pad,
    pad_id_of,
)
from zoo_gym.core.delta import Delta
from zoo_gym.core.protocol import POLICY_OBJECTIVES, PolicyObjective
from zoo_gym.core.rewards import RewardFunction, total_reward

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
) -> RoundResult:
    """Train what `trainer.begin_round(seed)` returns for `steps` GRPO or GSPO steps.

    `prompts` are (conversation, answer) pairs (`prompts_from_conversations`); each
    step uses `batch_size` of them with `num_generations` completions each, so
    ``batch_size * num_generations`` sequences. Prompts are cut on the left to leave
    `max_new_tokens` within `max_length`. Deterministic under `seed` on one device.
    """
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
    mode: PolicyObjective = "gspo" if objective == "gspo" else "grpo"
    start = time.perf_counter()
    model, tokenizer, device = trainer.model, trainer.tokenizer, trainer.device
    pad_id = pad_id_of(tokenizer)
    eos_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else pad_id
    room = max(1, max_length - max_new_tokens)
    encoded = [encode_prompt(tokenizer, conversation)[-room:] for conversation, _ in prompts]
    answers = [answer for _, answer in prompts]
    params = trainer.begin_round(seed)
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    batches = prompt_batches(len(prompts), batch_size, torch.Generator().manual_seed(seed))
    forks = [device] if device.type == "cuda" else []
    losses: list[float] = []
    step_rewards: list[float] = []
    tokens = 0
    for step in range(1, steps + 1):
        # 1. sample: every prompt of the batch num_generations times, left-padded, adapter on
        rows = [i for i in next(batches) for _ in range(num_generations)]
        prompt_ids, prompt_mask = left_pad([encoded[i] for i in rows], pad_id)
        prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
        model.eval()
        with torch.no_grad(), torch.random.fork_rng(devices=forks):
            torch.manual_seed(step_seed(seed, step))
            sequences = model.generate(
                input_ids=prompt_ids,
                attention_mask=prompt_mask,
                do_sample=True,
                temperature=temperature,
                top_k=0,
                top_p=1.0,
                max_new_tokens=max_new_tokens,
                pad_token_id=pad_id,
                eos_token_id=eos_id,
            )  # (n, p + c)
        width = prompt_ids.shape[1]
        completions = sequences[:, width:]  # (n, c)
        mask = completion_mask(completions, eos_id)  # (n, c)
        attention = torch.cat([prompt_mask, mask.long()], dim=1)  # (n, p + c)

        # 2. rewards, summed over functions; 3. group-relative advantages
        texts = [
            tokenizer.decode(row[m].tolist(), skip_special_tokens=True)
            for row, m in zip(completions, mask, strict=True)
        ]
        scores = torch.tensor(
            [total_reward(rewards, text, answers[i]) for text, i in zip(texts, rows, strict=True)],
            dtype=torch.float32,
        )
        advantages = group_advantages(scores, num_generations).to(device)  # (n,)

        # 4. log-probs of the sampling policy (pi_old) and of the reference (adapter off)
        with torch.no_grad():
            old_logp = token_logprobs(model, sequences, attention, width, temperature)
            ref_logp = None
            if kl_beta > 0:
                with trainer.reference():
                    ref_logp = token_logprobs(model, sequences, attention, width, temperature)
        model.train()
        for _ in range(iterations):
            logp = token_logprobs(model, sequences, attention, width, temperature)
            loss, kl = policy_loss(
                logp,
                old_logp,
                ref_logp,
                mask,
                advantages,
                objective=mode,
                clip_epsilon=clip_epsilon,
                kl_beta=kl_beta,
            )
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
        losses.append(loss.item())
        step_rewards.append(float(scores.mean()))
        tokens += int(attention.sum())
        logger.debug(
            "step %d: loss %.4f, reward %.3f, kl %.5f", step, losses[-1], step_rewards[-1], kl
        )
        if on_step is not None:
            rate = tokens / max(time.perf_counter() - start, 1e-9)
            on_step(
                StepInfo(
                    step=step,
                    steps=steps,
                    loss=losses[-1],
                    tokens_per_s=rate,
                    reward=step_rewards[-1],
                )
            )
    model.eval()
    seconds = time.perf_counter() - start
    mean_reward = mean_or_nan(step_rewards)
    logger.info(
        "%s round trained: %d steps, mean reward %.3f, %.1fs",
        objective,
        steps,
        mean_reward,
        seconds,
    )
    return RoundResult(
        update=trainer.update(),
        num_examples=len(prompts),
        mean_loss=mean_or_nan(losses),
        tokens=tokens,
        seconds=seconds,
        mean_reward=mean_reward,
    )
