"""GRPO / GSPO: the math on hand-computed tensors, then real rounds on the tiny model."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from zoo_gym.client.trainers.grpo import (
    Rollout,
    _Policy,
    _PolicyStep,
    group_advantages,
    policy_loss,
    token_logprobs,
    train_grpo,
)
from zoo_gym.client.trainers.reward_functions import load_reward_functions
from zoo_gym.client.trainers.sft import DpConfig, FfaLoraTrainer, StepInfo
from zoo_gym.compression import CodecSpec, decode, encode
from zoo_gym.core import synthetic
from zoo_gym.core.chat import (
    completion_mask,
    encode_prompt,
    left_pad,
    prompts_from_conversations,
    to_conversation,
)
from zoo_gym.core.lora import LoraSpec, frozen_a

SPEC = LoraSpec(rank=4, alpha=8.0)
PROMPTS = prompts_from_conversations(
    [to_conversation(r) for r in synthetic.make_examples(40, seed=3)]
)
REWARDS = load_reward_functions(["exact_answer", "format", "length"], [])
ROUND = dict(
    steps=3,
    lr=1e-2,
    batch_size=4,
    num_generations=4,
    max_new_tokens=6,
    temperature=1.0,
    clip_epsilon=0.2,
    kl_beta=0.04,
    rewards=REWARDS,
    max_length=64,
)


# ---- the math, by hand ----------------------------------------------------------------


def test_group_advantages_by_hand() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0])

    advantages = group_advantages(rewards, 4, eps=1e-4)

    # group 1: mean 0.25, sample std sqrt((0.75^2 + 3 * 0.25^2) / 3) = 0.5; group 2: all equal
    expected = [0.75 / 0.5001, -0.25 / 0.5001, -0.25 / 0.5001, -0.25 / 0.5001, 0, 0, 0, 0]
    torch.testing.assert_close(advantages, torch.tensor(expected))


LOGP = torch.tensor([[-1.0, -2.0], [-0.5, -0.7]])
OLD = torch.tensor([[-1.3, -1.5], [-0.5, -0.9]])
REF = torch.tensor([[-1.0, -2.2], [-0.4, 0.0]])
MASK = torch.tensor([[True, True], [True, False]])  # row 1's second token is after its EOS
ADV = torch.tensor([1.0, -1.0])


def test_grpo_clips_per_token_by_hand() -> None:
    loss, kl = policy_loss(
        LOGP, OLD, None, MASK, ADV, objective="grpo", clip_epsilon=0.2, kl_beta=0.0
    )

    # row 0, A = +1: ratios e^0.3 = 1.3499 (clipped to 1.2) and e^-0.5 = 0.6065 (kept: min)
    row0 = (1.2 + math.exp(-0.5)) / 2
    # row 1, A = -1: one token, ratio e^0 = 1
    row1 = -1.0
    assert loss.item() == pytest.approx(-(row0 + row1) / 2, abs=1e-6)
    assert kl.item() == 0.0


def test_gspo_clips_the_length_normalised_sequence_ratio_by_hand() -> None:
    loss, _ = policy_loss(
        LOGP, OLD, None, MASK, ADV, objective="gspo", clip_epsilon=0.2, kl_beta=0.0
    )

    # row 0: s = exp((0.3 - 0.5) / 2) = 0.9048, inside [0.8, 1.2]; no per-token clipping
    row0 = math.exp(-0.1)
    row1 = -1.0
    assert loss.item() == pytest.approx(-(row0 + row1) / 2, abs=1e-6)
    assert loss.item() != pytest.approx(
        policy_loss(LOGP, OLD, None, MASK, ADV, objective="grpo", clip_epsilon=0.2, kl_beta=0.0)[
            0
        ].item()
    )


def test_k3_kl_penalty_by_hand() -> None:
    loss0, _ = policy_loss(
        LOGP, OLD, None, MASK, ADV, objective="grpo", clip_epsilon=0.2, kl_beta=0
    )
    loss, kl = policy_loss(
        LOGP, OLD, REF, MASK, ADV, objective="grpo", clip_epsilon=0.2, kl_beta=0.1
    )

    # k3(d) = e^d - d - 1 with d = ref - logp: row 0 d = (0, -0.2), row 1 d = 0.1 (one token)
    k3 = lambda d: math.exp(d) - d - 1  # noqa: E731
    expected_kl = ((k3(0.0) + k3(-0.2)) / 2 + k3(0.1)) / 2
    assert kl.item() == pytest.approx(expected_kl, abs=1e-7)
    assert loss.item() == pytest.approx(loss0.item() + 0.1 * expected_kl, abs=1e-6)


def test_ratio_of_one_gives_the_advantage_weighted_log_prob_gradient() -> None:
    logp = LOGP.clone().requires_grad_(True)

    loss, _ = policy_loss(
        logp, LOGP, None, MASK, ADV, objective="grpo", clip_epsilon=0.2, kl_beta=0.0
    )
    loss.backward()

    # d loss / d logp_it = -A_i / (n |o_i|) on unmasked tokens
    expected = torch.tensor([[-1 / 4, -1 / 4], [1 / 2, 0.0]])
    assert logp.grad is not None
    torch.testing.assert_close(logp.grad, expected)


def test_completion_mask_stops_after_the_first_eos() -> None:
    completions = torch.tensor([[5, 2, 7, 2], [2, 0, 0, 0], [5, 6, 7, 8]])

    mask = completion_mask(completions, eos_id=2)

    assert mask.long().tolist() == [[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1]]


def test_left_pad() -> None:
    ids, mask = left_pad([[7, 8, 9], [5]], pad_id=0)

    assert ids.tolist() == [[7, 8, 9], [0, 0, 5]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_prompts_come_from_alpaca_and_sharegpt_records() -> None:
    record = {"instruction": "What is 2 + 3?", "input": "", "output": " 5 "}
    sharegpt = synthetic.to_sharegpt({"instruction": "Add 1 and 1.", "input": "", "output": "2"})

    prompts = prompts_from_conversations([to_conversation(record), to_conversation(sharegpt)])

    assert prompts == [
        ([{"role": "user", "content": "What is 2 + 3?"}], "5"),
        ([{"role": "user", "content": "Add 1 and 1."}], "2"),
    ]


# ---- real rounds on the tiny model ------------------------------------------------------


@pytest.fixture(scope="module")
def base_dir(tiny_home_template: Path) -> Path:
    return tiny_home_template / "base"


@pytest.fixture(scope="module")
def tokenizer(base_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(base_dir)


def trainer(base_dir: Path, tokenizer: PreTrainedTokenizerBase) -> FfaLoraTrainer:
    return FfaLoraTrainer(AutoModelForCausalLM.from_pretrained(base_dir), tokenizer, spec=SPEC)


def test_kl_is_zero_while_the_adapter_equals_the_reference(
    base_dir: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    t = trainer(base_dir, tokenizer)
    t.begin_round(5)  # B = 0: the adapted model is the base
    rows = [encode_prompt(tokenizer, conversation) for conversation, _ in PROMPTS[:3]]
    ids, mask = left_pad(rows, pad_id=0)
    prompt_length = ids.shape[1] - 2  # score the last two prompt tokens as a "completion"

    with torch.no_grad():
        logp = token_logprobs(t.model, ids, mask, prompt_length, 1.0)
        with t.reference():
            ref = token_logprobs(t.model, ids, mask, prompt_length, 1.0)
    _, kl = policy_loss(
        logp,
        logp,
        ref,
        torch.ones_like(logp, dtype=torch.bool),
        torch.ones(3),
        objective="grpo",
        clip_epsilon=0.2,
        kl_beta=0.04,
    )

    assert torch.equal(logp, ref)
    assert kl.item() == 0.0
    assert bool((logp < 0).all())


@pytest.mark.parametrize("objective", ["grpo", "gspo"])
def test_a_round_trains_only_b_and_reports_rewards(
    objective: str, base_dir: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    t = trainer(base_dir, tokenizer)
    before = {k: v.clone() for k, v in t.base.state_dict().items() if "lora_" not in k}
    infos: list[StepInfo] = []

    result = train_grpo(t, PROMPTS, objective=objective, seed=7, on_step=infos.append, **ROUND)  # type: ignore[arg-type]

    assert [i.step for i in infos] == [1, 2, 3]
    assert all(i.reward is not None and math.isfinite(i.reward) for i in infos)
    assert result.mean_reward == pytest.approx(sum(i.reward or 0.0 for i in infos) / 3)
    assert result.num_examples == len(PROMPTS) and result.tokens > 0
    assert set(result.update) == {m + ".lora_B" for m in t.shapes}
    assert max(float(b.abs().max()) for b in result.update.values()) > 0  # B moved
    after = t.base.state_dict()
    for key, tensor in before.items():  # the base weights are untouched
        assert torch.equal(tensor, after[key]), key
    for module, layer in t.layers.items():  # A stays the round's frozen A
        a = layer.lora_A["default"].weight
        assert torch.equal(a, frozen_a(7, module, a.shape[1], SPEC.rank))


def test_a_round_is_deterministic_under_its_seed(
    base_dir: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    first = train_grpo(trainer(base_dir, tokenizer), PROMPTS, objective="grpo", seed=3, **ROUND)  # type: ignore[arg-type]
    again = train_grpo(trainer(base_dir, tokenizer), PROMPTS, objective="grpo", seed=3, **ROUND)  # type: ignore[arg-type]
    other = train_grpo(trainer(base_dir, tokenizer), PROMPTS, objective="grpo", seed=4, **ROUND)  # type: ignore[arg-type]

    assert first.mean_reward == again.mean_reward
    for key in first.update:
        assert torch.equal(first.update[key], again.update[key]), key
    assert any(not torch.equal(first.update[k], other.update[k]) for k in first.update)


def test_the_update_of_a_grpo_round_goes_through_the_envelope(
    base_dir: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    result = train_grpo(trainer(base_dir, tokenizer), PROMPTS, objective="grpo", seed=1, **ROUND)  # type: ignore[arg-type]
    elements = sum(t.numel() for t in result.update.values())

    raw = decode(encode(result.update, CodecSpec(codec="none")), max_elements=elements)
    onebit = decode(encode(result.update, CodecSpec(codec="bitdelta")), max_elements=elements)

    assert set(raw) == set(onebit) == set(result.update)
    for key, b in result.update.items():
        assert torch.equal(raw[key], b), key  # lossless codec: bit-exact
        assert onebit[key].shape == b.shape
        nonzero = b != 0  # BitDelta keeps every sign
        assert torch.equal(torch.sign(onebit[key][nonzero]), torch.sign(b[nonzero])), key


def test_bad_arguments_are_refused(base_dir: Path, tokenizer: PreTrainedTokenizerBase) -> None:
    t = trainer(base_dir, tokenizer)
    with pytest.raises(ValueError, match="objective must be one of grpo, gspo"):
        train_grpo(t, PROMPTS, objective="ppo", seed=0, **ROUND)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least one prompt"):
        train_grpo(t, [], objective="grpo", seed=0, **ROUND)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_generations must be at least 2"):
        train_grpo(t, PROMPTS, objective="grpo", seed=0, **{**ROUND, "num_generations": 1})  # type: ignore[arg-type]


# ---- DP-SGD: one record is one prompt and its group of completions -----------------------

G = 3


def group_rollout(
    t: FfaLoraTrainer, tokenizer: PreTrainedTokenizerBase
) -> tuple[_Policy, Rollout, torch.Tensor]:
    """Three prompts, G completions each (rows of a prompt adjacent), and fixed advantages."""
    policy = _Policy(t, temperature=1.0, max_new_tokens=6)
    prompt_ids = [encode_prompt(tokenizer, c) for c, _ in PROMPTS[:3]]
    rollout = policy.sample([prompt_ids[i] for i in range(3) for _ in range(G)], seed=1)
    advantages = torch.randn(3 * G, generator=torch.Generator().manual_seed(0))
    return policy, rollout, advantages


def per_prompt_gradients(
    policy: _Policy, rollout: Rollout, advantages: torch.Tensor, params: list[torch.nn.Parameter]
) -> list[list[torch.Tensor]]:
    """Each prompt's gradient of its group loss, one prompt at a time with plain autograd."""
    with torch.no_grad():
        old = policy.logprobs(rollout)
        with policy.trainer.reference():
            ref = policy.logprobs(rollout)
    policy.trainer.model.train()
    grads = []
    for p in range(3):
        rows = slice(p * G, (p + 1) * G)
        group = Rollout(
            rollout.sequences[rows],
            rollout.prompt_length,
            rollout.mask[rows],
            rollout.attention[rows],
        )
        loss, _ = policy_loss(
            policy.logprobs(group),
            old[rows],
            ref[rows],
            group.mask,
            advantages[rows],
            objective="gspo",
            clip_epsilon=0.2,
            kl_beta=0.5,
        )
        grads.append(list(torch.autograd.grad(loss, params)))
    return grads


def dp_step(
    policy: _Policy,
    rollout: Rollout,
    advantages: torch.Tensor,
    params: list[torch.nn.Parameter],
    *,
    clip: float,
    noise: float,
) -> list[torch.Tensor]:
    """The gradient one DP-SGD step of `train_grpo` applies (lr 0: the weights stay)."""
    dp = DpConfig(max_grad_norm=clip, noise_multiplier=noise)
    optimizer = dp.optimizer(torch.optim.AdamW(params, lr=0.0), expected_batch_size=3)
    hooks = policy.trainer.grad_sample_module()
    try:
        _PolicyStep(policy, optimizer, "gspo", 0.2, 0.5, 1, G, per_prompt=True)(rollout, advantages)
    finally:
        hooks._close()
    return [p.grad.clone() for p in params]  # type: ignore[union-attr]


def test_dp_sgd_clips_each_prompts_group_gradient_and_adds_noise(
    base_dir: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    # Prepare: a trained-looking adapter (B not zero, so the KL term has a gradient)
    t = trainer(base_dir, tokenizer)
    params = t.begin_round(3)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in params:
            p.normal_(std=0.05, generator=generator)
    policy, rollout, advantages = group_rollout(t, tokenizer)
    grads = per_prompt_gradients(policy, rollout, advantages, params)
    norms = [float(torch.sqrt(sum(g.pow(2).sum() for g in r))) for r in grads]
    clip = sorted(norms)[1]  # the largest clipped, the smallest not
    factors = [min(1.0, clip / (n + 1e-6)) for n in norms]
    expected = [
        sum(f * r[k] for f, r in zip(factors, grads, strict=True)) / 3 for k in range(len(params))
    ]

    # Execute
    clean = dp_step(policy, rollout, advantages, params, clip=clip, noise=0.0)
    noisy = dp_step(policy, rollout, advantages, params, clip=clip, noise=2.0)

    # Assert: clipped per prompt (not per completion); noise of std 2 * clip / 3 per coordinate
    assert min(norms) < clip < max(norms)
    for got, want in zip(clean, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-7)
    noise = torch.cat([(n - c).flatten() for n, c in zip(noisy, clean, strict=True)])
    assert noise.numel() > 2000
    assert float(noise.std()) == pytest.approx(2.0 * clip / 3, rel=0.05)


def test_a_dp_round_samples_prompts_at_the_planned_rate(
    base_dir: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    t = trainer(base_dir, tokenizer)
    dp = DpConfig(max_grad_norm=1.0, noise_multiplier=1.0, sample_rate=0.1)

    result = train_grpo(t, PROMPTS, objective="grpo", seed=1, dp=dp, **ROUND)  # type: ignore[arg-type]

    assert result.sample_rate == 0.1 and result.mean_reward == result.mean_reward
    assert all(float(b.abs().max()) > 0 for b in result.update.values())
    assert not any(hasattr(p, "grad_sample") for p in t.model.parameters())
    with pytest.raises(ValueError, match="set iterations to 1"):
        train_grpo(t, PROMPTS, objective="gspo", seed=1, dp=dp, iterations=2, **ROUND)  # type: ignore[arg-type]
