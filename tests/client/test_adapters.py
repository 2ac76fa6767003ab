"""Plain LoRA, DoRA, QLoRA and full fine-tuning on the tiny model, and their way to the coordinator."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from zoo_gym.client.trainers.adapters import (
    DoraTrainer,
    FullTrainer,
    LoraTrainer,
    QLoraTrainer,
    attention_implementation,
    make_trainer,
)
from zoo_gym.client.trainers.sft import DpConfig, FfaLoraTrainer, Trainer
from zoo_gym.compression import CodecSpec, decode, encode
from zoo_gym.coordinator.rounds import RoundSummary
from zoo_gym.core import synthetic
from zoo_gym.core.chat import collate, encode_conversation, pad_id_of, to_conversation, token_nll
from zoo_gym.core.evaluate import validation_loss
from zoo_gym.core.lora import LoraSpec, frozen_a, merge_update, update_shapes
from zoo_gym.core.tiny import tiny_config
from zoo_gym.core.weights import load_weights
from zoo_gym.simulation.inprocess import InProcessFederation

SPEC = LoraSpec(rank=4, alpha=8.0)
TRAIN = [to_conversation(r) for r in synthetic.make_examples(200, seed=1)]
VALID = synthetic.make_examples(64, seed=999)
LR = {"lora": 1e-2, "dora": 1e-2, "qlora": 1e-2, "full": 2e-3}
DENSE = ("lora", "dora", "qlora", "full")


@pytest.fixture(scope="module")
def base_dir(tiny_home_template: Path) -> Path:
    return tiny_home_template / "base"  # the tiny base, seed 0; read only


@pytest.fixture(scope="module")
def tokenizer(base_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(base_dir)


def logits(model: torch.nn.Module, seed: int = 0) -> torch.Tensor:
    input_ids = torch.randint(300, (2, 12), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        out = model(input_ids=input_ids).logits
    assert isinstance(out, torch.Tensor)
    return out


@pytest.mark.parametrize("adapter", DENSE)
def test_round_update_goes_through_the_envelope_and_lowers_validation_loss(
    base_dir: Path, tokenizer: PreTrainedTokenizerBase, adapter: str
) -> None:
    # Prepare
    trainer = make_trainer(base_dir, tokenizer, adapter=adapter, spec=SPEC)
    state = load_weights(base_dir)
    reference = AutoModelForCausalLM.from_pretrained(base_dir)
    before = validation_loss(reference, tokenizer, VALID)

    # Execute: one round, then the coordinator's path: envelope, layout, merge
    result = trainer.train_round(
        TRAIN, seed=7, steps=30, lr=LR[adapter], batch_size=16, max_length=64
    )
    payload = encode(result.update, CodecSpec(codec="none"))
    received = decode(payload, max_elements=sum(t.numel() for t in result.update.values()))
    merge_update(state, received, adapter=adapter, spec=SPEC, seed=7)
    reference.load_state_dict(state)
    after = validation_loss(reference, tokenizer, VALID)

    # Assert: dense deltas keyed by base weight names, in the coordinator's layout
    expected = update_shapes(load_weights(base_dir), adapter=adapter, spec=SPEC)
    assert {k: tuple(v.shape) for k, v in received.items()} == expected
    assert all(v.dtype == torch.float32 for v in received.values())
    for key, tensor in result.update.items():
        assert torch.equal(received[key], tensor)
    assert trainer.adapter == adapter
    assert after < before - 1.0, (before, after)


@pytest.mark.parametrize("adapter", ["lora", "dora"])
def test_dense_delta_equals_merged_minus_base(
    base_dir: Path, tokenizer: PreTrainedTokenizerBase, adapter: str
) -> None:
    # Prepare
    trainer = make_trainer(base_dir, tokenizer, adapter=adapter, spec=SPEC)
    assert isinstance(trainer, LoraTrainer | DoraTrainer)
    base = load_weights(base_dir)
    result = trainer.train_round(TRAIN[:64], seed=3, steps=5, lr=1e-2, batch_size=8, max_length=64)
    adapted = logits(trainer.model)

    # Execute: peft's own merge is the reference
    merged = trainer.model.merge_and_unload().state_dict()

    # Assert
    for name, weight in base.items():
        delta = merged[name] - weight
        if name in result.update:
            torch.testing.assert_close(result.update[name], delta, atol=2e-6, rtol=1e-4)
            assert float(delta.abs().max()) > 1e-4
        else:
            assert torch.equal(delta, torch.zeros_like(delta)), name
    merge_update(base, result.update, adapter=adapter, spec=SPEC, seed=3)
    plain = AutoModelForCausalLM.from_pretrained(base_dir)
    plain.load_state_dict(base)
    torch.testing.assert_close(logits(plain), adapted, atol=1e-4, rtol=1e-4)


def test_lora_clients_start_equal_and_train_both_factors(
    base_dir: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    # Prepare
    first = make_trainer(base_dir, tokenizer, adapter="lora", spec=SPEC)
    second = make_trainer(base_dir, tokenizer, adapter="lora", spec=SPEC)
    assert isinstance(first, LoraTrainer) and isinstance(second, LoraTrainer)
    module = "model.layers.1.mlp.down_proj"

    # Execute
    params = first.begin_round(5)
    second.begin_round(5)

    # Assert: A is the seed's A on both, B is zero, the update starts at zero
    a1 = first.layers[module].lora_A["default"].weight
    assert torch.equal(a1, second.layers[module].lora_A["default"].weight)
    assert torch.equal(a1, frozen_a(5, module, 128, SPEC.rank))
    assert all(float(t.abs().max()) == 0.0 for t in first.update().values())
    trainable = {n for n, p in first.model.named_parameters() if p.requires_grad}
    assert len(params) == len(trainable) == 2 * len(first.layers)
    assert all("lora_A" in n or "lora_B" in n for n in trainable)


def test_dora_round_starts_at_the_base_model(
    base_dir: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    # Prepare: a trained round moved the magnitudes
    trainer = make_trainer(base_dir, tokenizer, adapter="dora", spec=SPEC)
    trainer.train_round(TRAIN[:64], seed=3, steps=5, lr=1e-2, batch_size=8, max_length=64)
    base = logits(AutoModelForCausalLM.from_pretrained(base_dir))
    assert float((logits(trainer.model) - base).abs().max()) > 1e-3

    # Execute
    params = trainer.begin_round(4)

    # Assert: A, B and the magnitude train; the model is the base again
    assert len(params) == 3 * len(trainer.shapes)
    torch.testing.assert_close(logits(trainer.model), base, atol=1e-5, rtol=1e-5)
    assert all(float(t.abs().max()) < 1e-5 for t in trainer.update().values())


def test_qlora_runs_a_4bit_base_and_requantises_a_new_base(
    base_dir: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    from bitsandbytes.functional import dequantize_4bit, quantize_4bit
    from bitsandbytes.nn.modules import Linear4bit

    # Prepare
    trainer = make_trainer(base_dir, tokenizer, adapter="qlora", spec=SPEC)
    assert isinstance(trainer, QLoraTrainer)
    layer = trainer.layers["model.layers.0.self_attn.q_proj"].get_base_layer()
    assert isinstance(layer, Linear4bit)
    state = {k: v + 0.05 for k, v in load_weights(base_dir).items()}

    # Execute
    trainer.load_base(state)

    # Assert: the new weights are in, within NF4's rounding; unquantised tensors exactly
    layer = trainer.layers["model.layers.0.self_attn.q_proj"].get_base_layer()
    weight = dequantize_4bit(layer.weight.data, layer.weight.quant_state)  # type: ignore[attr-defined]
    new = state["model.layers.0.self_attn.q_proj.weight"]
    packed, quant_state = quantize_4bit(new, quant_type="nf4", compress_statistics=True)
    torch.testing.assert_close(weight, dequantize_4bit(packed, quant_state))
    assert float((weight - new).abs().mean()) < 0.2 * float((weight - (new - 0.05)).abs().mean())
    assert torch.equal(trainer.base.model.embed_tokens.weight, state["model.embed_tokens.weight"])
    assert torch.equal(layer.bias, state["model.layers.0.self_attn.q_proj.bias"])
    result = trainer.train_round(TRAIN[:32], seed=1, steps=2, lr=1e-2, batch_size=8, max_length=64)
    assert all(float(t.abs().max()) > 0 for t in result.update.values())
    with pytest.raises(ValueError, match="missing"):
        trainer.load_base({k: v for k, v in state.items() if "q_proj.weight" not in k})


def test_full_fine_tuning_reference_and_size_limit(
    base_dir: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    # Prepare
    trainer = make_trainer(base_dir, tokenizer, adapter="full", spec=SPEC)
    assert isinstance(trainer, FullTrainer)
    base = logits(AutoModelForCausalLM.from_pretrained(base_dir))

    # Execute
    result = trainer.train_round(TRAIN[:64], seed=2, steps=3, lr=1e-3, batch_size=8, max_length=64)
    trained = logits(trainer.model)
    with trainer.reference():
        inside = logits(trainer.model)

    # Assert: the reference is the published base; the weights come back after it
    torch.testing.assert_close(inside, base)
    assert torch.equal(logits(trainer.model), trained)
    assert float((trained - base).abs().max()) > 1e-3
    assert set(result.update) == set(load_weights(base_dir))
    with pytest.raises(ValueError, match=r"full fine-tuning is limited to 1,000 parameters"):
        make_trainer(base_dir, tokenizer, adapter="full", spec=SPEC, max_full_params=1000)
    with pytest.raises(ValueError, match=r"full fine-tuning is limited"):
        FullTrainer(
            AutoModelForCausalLM.from_pretrained(base_dir), tokenizer, spec=SPEC, max_params=1
        )


def test_gradient_checkpointing_gives_the_same_gradients(
    base_dir: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    # Prepare
    examples = [encode_conversation(tokenizer, c, max_length=64) for c in TRAIN[:8]]
    batch = collate(examples, pad_id=pad_id_of(tokenizer))
    grads = []

    # Execute: one forward and backward with and without checkpointing
    for checkpointing in (False, True):
        trainer = make_trainer(
            base_dir, tokenizer, adapter="lora", spec=SPEC, gradient_checkpointing=checkpointing
        )
        params = trainer.begin_round(9)
        trainer.model.train()
        nll, mask = token_nll(trainer.model, batch)
        (nll.sum() / mask.sum()).backward()  # type: ignore[no-untyped-call]
        grads.append([p.grad.clone() for p in params if p.grad is not None])
        assert trainer.base.is_activation_checkpointing == checkpointing

    # Assert
    assert len(grads[0]) == len(grads[1]) > 0
    for plain, recomputed in zip(grads[0], grads[1], strict=True):
        torch.testing.assert_close(recomputed, plain, atol=1e-6, rtol=1e-5)


def test_make_trainer_refuses_what_it_cannot_run(
    base_dir: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    with pytest.raises(ValueError, match="unknown adapter 'adalora'; the client knows ffa_lora"):
        make_trainer(base_dir, tokenizer, adapter="adalora", spec=SPEC)
    model = AutoModelForCausalLM.from_pretrained(base_dir)
    with pytest.raises(ValueError, match="pass the model directory"):
        make_trainer(model, tokenizer, adapter="qlora", spec=SPEC)
    assert isinstance(make_trainer(model, tokenizer, adapter="ffa_lora", spec=SPEC), FfaLoraTrainer)
    assert attention_implementation("cpu") == "sdpa"


# ---- DP-SGD: per-record gradients against one record at a time ---------------------------

DP_RECORDS = TRAIN[:4]


def dp_trainer(adapter: str, base_dir: Path, tokenizer: PreTrainedTokenizerBase) -> Trainer:
    """`adapter`'s trainer; ``full`` on a Llama with tied embeddings (RMSNorm, one weight used
    by the embedding and the head)."""
    if adapter == "qlora":
        pytest.importorskip("bitsandbytes")
    if adapter != "full":
        return make_trainer(base_dir, tokenizer, adapter=adapter, spec=SPEC)
    config = tiny_config(vocab_size=len(tokenizer), arch="llama")
    config.tie_word_embeddings = True
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return FullTrainer(model, tokenizer, spec=SPEC)


def per_record_gradients(
    trainer: Trainer, tokenizer: PreTrainedTokenizerBase, seed: int
) -> tuple[list[torch.nn.Parameter], list[list[torch.Tensor]]]:
    """The round's parameters and each record's gradient of its token-mean loss, computed
    one record at a time with plain autograd (a tied weight: the sum of both uses)."""
    params = trainer.begin_round(seed)
    trainer.model.train()
    grads = []
    for conversation in DP_RECORDS:
        example = encode_conversation(tokenizer, conversation, max_length=64)
        nll, mask = token_nll(trainer.model, collate([example], pad_id=pad_id_of(tokenizer)))
        grads.append(list(torch.autograd.grad(nll.sum() / mask.sum(), params)))
    return params, grads


def clipped_mean(grads: list[list[torch.Tensor]], clip: float) -> list[torch.Tensor]:
    """DP-SGD's gradient without noise: each record's gradient scaled to norm <= clip (one norm
    over all parameters), summed, divided by the batch size."""
    norms = [torch.sqrt(sum(g.pow(2).sum() for g in record)) for record in grads]
    factors = [min(1.0, clip / (float(n) + 1e-6)) for n in norms]
    return [
        sum(f * record[k] for f, record in zip(factors, grads, strict=True)) / len(grads)
        for k in range(len(grads[0]))
    ]


@pytest.mark.parametrize("adapter", ["dora", "qlora", "full"])
def test_dp_sgd_clips_each_record_and_adds_noise_of_the_set_scale(
    base_dir: Path, tokenizer: PreTrainedTokenizerBase, adapter: str
) -> None:
    # Prepare: every record's gradient, one at a time; a clip norm between their norms
    trainer = dp_trainer(adapter, base_dir, tokenizer)
    params, grads = per_record_gradients(trainer, tokenizer, seed=5)
    norms = sorted(float(torch.sqrt(sum(g.pow(2).sum() for g in r))) for r in grads)
    clip = (norms[1] + norms[2]) / 2  # two records clipped, two not
    expected = clipped_mean(grads, clip)
    trainable = {id(p) for p in trainer.model.parameters() if p.requires_grad}
    one_step = dict(seed=5, steps=1, lr=0.0, batch_size=4, max_length=64)  # rate 1: all four

    # Execute: one DP-SGD step without noise, then one with noise
    quiet = trainer.train_round(
        DP_RECORDS, dp=DpConfig(max_grad_norm=clip, noise_multiplier=0.0), **one_step
    )  # type: ignore[arg-type]
    clean = [p.grad.clone() for p in params]  # type: ignore[union-attr]
    trainer.train_round(
        DP_RECORDS, dp=DpConfig(max_grad_norm=clip, noise_multiplier=2.0), **one_step
    )  # type: ignore[arg-type]
    noise = torch.cat([(p.grad - e).flatten() for p, e in zip(params, expected, strict=True)])  # type: ignore[operator]

    # Assert: every trainable parameter took part; per-record clipping as computed by hand
    assert quiet.sample_rate == 1.0 and trainable == {id(p) for p in params}
    assert norms[1] < clip < norms[2]
    for got, want in zip(clean, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-7)
    assert noise.numel() > 5000
    assert float(noise.std()) == pytest.approx(2.0 * clip / 4, rel=0.05)


@pytest.mark.parametrize("adapter", DENSE)
def test_a_federated_round_of_each_adapter_publishes_a_better_model(
    tiny_home: Path, adapter: str
) -> None:
    # Prepare: two contributors, one round, the policy's adapter
    shards = synthetic.shard(synthetic.make_examples(2 * 60, seed=4), 2)
    lr = 2e-3 if adapter == "full" else 5e-3
    overrides = {
        "rounds": 1,
        "min_clients": 2,
        "training": {"adapter": adapter, "steps": 20, "learning_rate": lr},
    }
    fed = InProcessFederation.build(tiny_home, shards, overrides=overrides)

    # Execute
    (summary,) = fed.run()

    # Assert: both dense updates passed intake (layout = base weight names) and improved the base
    assert (summary.status, summary.accepted, summary.aggregated) == ("published", 2, 2)
    assert summary.loss_after < summary.loss_before - 0.2, summary
    assert all(
        r.trainer is not None and r.trainer.adapter == adapter for r in fed.runtimes.values()
    )


def test_a_policy_change_switches_the_adapter_between_rounds(tiny_home: Path) -> None:
    # Prepare: round 1 runs FFA-LoRA; an operator switches to plain LoRA for round 2
    from zoo_gym.coordinator.control import PolicyChange

    shards = synthetic.shard(synthetic.make_examples(2 * 40, seed=5), 2)
    fed = InProcessFederation.build(
        tiny_home, shards, overrides={"rounds": 2, "min_clients": 2, "training": {"steps": 10}}
    )
    co = fed.coordinator
    training = co.config.training.model_copy(update={"adapter": "lora"})
    staged = co.config.model_copy(update={"training": training})

    def after(summary: RoundSummary) -> None:
        if summary.round == 1:
            co.control.stage_policy(
                PolicyChange(staged, {"adapter": ("ffa_lora", "lora")}, by="admin")
            )

    # Execute
    summaries = fed.run(on_round=after)

    # Assert: both rounds passed intake (the layout followed) and published; the clients
    # rebuilt their trainer for the new adapter
    assert [(s.status, s.accepted) for s in summaries] == [("published", 2), ("published", 2)]
    assert all(r.trainer is not None and r.trainer.adapter == "lora" for r in fed.runtimes.values())
    assert summaries[1].loss_after < summaries[0].loss_before
