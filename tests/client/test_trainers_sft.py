import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from zoo_gym.client.trainers.sft import DpConfig, FfaLoraTrainer, StepInfo
from zoo_gym.core import synthetic
from zoo_gym.core.chat import to_conversation
from zoo_gym.core.evaluate import validation_loss
from zoo_gym.core.lora import LoraSpec, dense_delta, frozen_a, merge_ffa, target_weights
from zoo_gym.core.tiny import create_tiny_base

SPEC = LoraSpec(rank=4, alpha=8.0)
TRAIN = [to_conversation(r) for r in synthetic.make_examples(200, seed=1)]
VALID = synthetic.make_examples(64, seed=999)
ROUND = dict(steps=30, lr=1e-2, batch_size=16, max_length=64)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny")
    create_tiny_base(directory, seed=0)
    return directory


@pytest.fixture(scope="module")
def tokenizer(base_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(base_dir)


def trainer(
    base_dir: Path, tokenizer: PreTrainedTokenizerBase, spec: LoraSpec = SPEC
) -> FfaLoraTrainer:
    return FfaLoraTrainer(AutoModelForCausalLM.from_pretrained(base_dir), tokenizer, spec=spec)


def test_merging_the_update_reproduces_the_adapted_model(
    base_dir: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    t = trainer(base_dir, tokenizer)
    result = t.train_round(TRAIN, seed=11, steps=5, lr=1e-2, batch_size=8, max_length=64)
    merged = AutoModelForCausalLM.from_pretrained(base_dir)
    state = merged.state_dict()
    input_ids = torch.randint(len(tokenizer), (2, 16), generator=torch.Generator().manual_seed(0))

    dense = dense_delta(result.update, spec=SPEC, seed=11, shapes=target_weights(state, SPEC))
    merge_ffa(state, result.update, spec=SPEC, seed=11)

    assert set(dense) == {m + ".weight" for m in target_weights(state, SPEC)}
    assert max(float(d.abs().max()) for d in dense.values()) > 1e-3
    with torch.no_grad():
        adapted = t.model(input_ids=input_ids).logits
        plain = merged(input_ids=input_ids).logits
        base = AutoModelForCausalLM.from_pretrained(base_dir)(input_ids=input_ids).logits
    torch.testing.assert_close(plain, adapted, atol=1e-5, rtol=1e-5)
    assert float((base - adapted).abs().max()) > 1e-2


def test_the_a_seed_sets_a_and_the_round_seed_the_batches(
    base_dir: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    t = trainer(base_dir, tokenizer)
    kw = dict(steps=3, lr=1e-2, batch_size=4, max_length=64)

    first = t.train_round(TRAIN[:40], seed=1, a_seed=5, **kw).update  # type: ignore[arg-type]
    again = t.train_round(TRAIN[:40], seed=1, a_seed=5, **kw).update  # type: ignore[arg-type]
    other_batches = t.train_round(TRAIN[:40], seed=2, a_seed=5, **kw).update  # type: ignore[arg-type]

    for name, layer in t.layers.items():
        a = layer.lora_A["default"].weight  # type: ignore[index]
        assert torch.equal(a.detach().cpu(), frozen_a(5, name, a.shape[1], SPEC.rank))
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert any(not torch.equal(first[k], other_batches[k]) for k in first)


def test_update_shapes_and_what_trains(base_dir: Path, tokenizer: PreTrainedTokenizerBase) -> None:
    t = trainer(base_dir, tokenizer)
    before = {k: v.clone() for k, v in t.base.state_dict().items() if "lora_" not in k}
    infos: list[StepInfo] = []

    result = t.train_round(
        TRAIN[:20], seed=1, steps=3, lr=1e-2, batch_size=4, max_length=64, on_step=infos.append
    )

    assert [i.step for i in infos] == [1, 2, 3] and infos[-1].steps == 3
    assert all(i.tokens_per_s > 0 for i in infos)
    assert result.num_examples == 20 and result.tokens > 0 and result.seconds > 0
    assert set(result.update) == {m + ".lora_B" for m in t.shapes}
    for key, b in result.update.items():
        module = key.removesuffix(".lora_B")
        assert b.shape == (t.shapes[module][0], SPEC.rank) and b.dtype == torch.float32
    after = t.base.state_dict()
    for key, tensor in before.items():  # training leaves the base weights alone
        assert torch.equal(tensor, after[key]), key
    for module, layer in t.layers.items():  # and A stays the round's frozen A
        a = layer.lora_A["default"].weight
        assert torch.equal(a, frozen_a(1, module, a.shape[1], SPEC.rank))
    trainable = [n for n, p in t.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_B" in n for n in trainable)


def test_a_is_shared_across_trainers_and_differs_across_seeds(
    base_dir: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    first, second = trainer(base_dir, tokenizer), trainer(base_dir, tokenizer)
    module = "model.layers.1.mlp.down_proj"

    first.reset_adapters(5)
    second.reset_adapters(5)
    a1 = first.layers[module].lora_A["default"].weight.detach().clone()
    a2 = second.layers[module].lora_A["default"].weight.detach().clone()
    second.reset_adapters(6)
    a3 = second.layers[module].lora_A["default"].weight.detach().clone()

    assert torch.equal(a1, a2)
    assert torch.equal(a1, frozen_a(5, module, 128, SPEC.rank))
    assert not torch.equal(a1, a3)


def test_rounds_are_deterministic(base_dir: Path, tokenizer: PreTrainedTokenizerBase) -> None:
    t = trainer(base_dir, tokenizer)

    first = t.train_round(TRAIN[:40], seed=3, steps=4, lr=1e-2, batch_size=8, max_length=64)
    second = t.train_round(TRAIN[:40], seed=3, steps=4, lr=1e-2, batch_size=8, max_length=64)
    third = t.train_round(TRAIN[:40], seed=4, steps=4, lr=1e-2, batch_size=8, max_length=64)

    assert first.mean_loss == second.mean_loss
    for key in first.update:
        assert torch.equal(first.update[key], second.update[key])
    assert any(not torch.equal(first.update[k], third.update[k]) for k in first.update)


def test_load_base_replaces_weights(base_dir: Path, tokenizer: PreTrainedTokenizerBase) -> None:
    t = trainer(base_dir, tokenizer)
    state = AutoModelForCausalLM.from_pretrained(base_dir).state_dict()
    state = {k: v + 0.01 for k, v in state.items()}

    t.load_base(state)

    layer = t.layers["model.layers.0.self_attn.q_proj"]
    assert torch.equal(layer.base_layer.weight, state["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(t.base.lm_head.weight, state["lm_head.weight"])
    with pytest.raises(ValueError, match="missing"):
        t.load_base({k: v for k, v in state.items() if k != "lm_head.weight"})


def test_three_federated_rounds_lower_validation_loss(
    base_dir: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    # Two clients per round; the coordinator averages their B's and merges into the base.
    reference = AutoModelForCausalLM.from_pretrained(base_dir)
    state = {k: v.clone() for k, v in reference.state_dict().items()}
    clients = synthetic.shard([to_conversation(r) for r in synthetic.make_examples(400, seed=2)], 2)  # type: ignore[arg-type]
    t = trainer(base_dir, tokenizer, LoraSpec())
    losses = [validation_loss(reference, tokenizer, VALID)]
    start = time.perf_counter()

    for round_seed in (100, 101, 102):
        updates = []
        for data in clients:
            t.load_base(state)
            updates.append(t.train_round(data, seed=round_seed, **ROUND).update)  # type: ignore[arg-type]
        mean = {k: torch.stack([u[k] for u in updates]).mean(0) for k in updates[0]}
        merge_ffa(state, mean, spec=LoraSpec(), seed=round_seed)
        reference.load_state_dict(state)
        losses.append(validation_loss(reference, tokenizer, VALID))

    print(
        f"validation loss per round: {[round(x, 3) for x in losses]}, {time.perf_counter() - start:.1f}s"
    )
    assert losses[1] < losses[0] - 2.0
    assert losses[3] < losses[1]
    assert losses[3] < 0.45 * losses[0]


def test_dp_sgd_under_opacus_trains_b(base_dir: Path, tokenizer: PreTrainedTokenizerBase) -> None:
    # Opacus silently skips parameters it did not hook; B must still move, and only B.
    t = trainer(base_dir, tokenizer)
    quiet = DpConfig(max_grad_norm=1.0, noise_multiplier=0.0)

    result = t.train_round(
        TRAIN[:64], seed=2, steps=8, lr=1e-2, batch_size=16, max_length=64, dp=quiet
    )

    assert result.sample_rate == 0.25
    assert all(float(b.abs().max()) > 0 for b in result.update.values())
    assert result.mean_loss == result.mean_loss  # finite, not nan
    assert not any(
        hasattr(p, "grad_sample") and p.grad_sample is not None for p in t.model.parameters()
    )
    again = t.train_round(
        TRAIN[:64], seed=2, steps=8, lr=1e-2, batch_size=16, max_length=64, dp=quiet
    )
    assert again.update.keys() == result.update.keys()
    # no noise, same public seed: only the secret Poisson sampling can tell the rounds apart
    assert any(not torch.equal(again.update[k], result.update[k]) for k in result.update)


def test_dp_sgd_clips_per_example_and_adds_noise(
    base_dir: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    t = trainer(base_dir, tokenizer)
    one_step = dict(seed=2, steps=1, lr=1e-3, batch_size=16, max_length=64)

    first = t.train_round(
        TRAIN[:64], dp=DpConfig(max_grad_norm=1e-6, noise_multiplier=1.0), **one_step
    )  # type: ignore[arg-type]
    second = t.train_round(
        TRAIN[:64], dp=DpConfig(max_grad_norm=1e-6, noise_multiplier=1.0), **one_step
    )  # type: ignore[arg-type]

    # Same data and seed: only the secret noise differs between the two rounds.
    assert any(not torch.equal(first.update[k], second.update[k]) for k in first.update)
