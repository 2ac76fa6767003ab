"""Rounds on real Hugging Face families: GPT-2 (Conv1D), Llama, Qwen2, Mistral, Phi-3, tied embeddings.

Each test makes a coordinator home from a tiny model of one family (`families.save_family`),
runs one round with one contributor on the in-process federation (codec ``none``, FedAvg, so
the aggregate is that contributor's update) and checks that the published weights are what the
client's trained adapter means: peft's own `merge_and_unload()` of the adapter on the base
(``lora``, ``dora``; ``ffa_lora`` with the seed-derived A the client trained with), peft's
delta of each 4-bit layer (``qlora``), or the client's trained weights (``full``). Each round
takes well under a second.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from families import save_family
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from zoo_gym.client.trainers.adapters import FullTrainer
from zoo_gym.client.trainers.sft import PeftTrainer
from zoo_gym.coordinator.setup import init_home
from zoo_gym.core.lora import LoraSpec, linear_layers_of, update_shapes
from zoo_gym.core.synthetic import make_examples, write_jsonl
from zoo_gym.core.tiny import task_tokenizer
from zoo_gym.simulation.inprocess import InProcessFederation

ROUND = {
    "rounds": 1,
    "min_clients": 1,
    "aggregator": "fedavg",
    "byzantine_f": 0,
    "quality_gate_tolerance": 100.0,  # random bases: this checks the merge, not the learning
    "rewards": {"method": "none"},
}
LR = {"ffa_lora": 1e-2, "lora": 1e-2, "dora": 1e-2, "qlora": 1e-2, "full": 1e-3}


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    return task_tokenizer()


@pytest.fixture(scope="module")
def base_of(
    tmp_path_factory: pytest.TempPathFactory, tokenizer: PreTrainedTokenizerBase
) -> Callable[[str], Path]:
    """The directory of a family's tiny base, written once per module (read only)."""
    made: dict[str, Path] = {}

    def base(family: str) -> Path:
        if family not in made:
            made[family] = save_family(family, tmp_path_factory.mktemp(family), tokenizer)
        return made[family]

    return base


def one_round(base: Path, tmp_path: Path, adapter: str) -> tuple[InProcessFederation, Path]:
    """A home made from `base`, one round of `adapter` by one contributor; the federation and
    the published version's directory."""
    validation = tmp_path / "validation.jsonl"
    write_jsonl(make_examples(16, seed=99), validation)
    init_home(tmp_path / "home", tiny=False, base_model=base, validation=validation, settings="")
    training = {"adapter": adapter, "steps": 3, "batch_size": 8, "learning_rate": LR[adapter]}
    overrides = {**ROUND, "training": {**training, "codec": "none", "lora_rank": 4}}
    fed = InProcessFederation.build(
        tmp_path / "home", [make_examples(24, seed=1)], overrides=overrides
    )
    (summary,) = fed.run()
    assert summary.status == "published", summary
    assert (summary.accepted, summary.aggregated) == (1, 1)
    return fed, fed.coordinator.registry.directory(summary.published_version)


def client_model(fed: InProcessFederation) -> PeftModel | PreTrainedModel:
    (runtime,) = fed.runtimes.values()
    assert runtime.trainer is not None
    return runtime.trainer.model


def assert_published_is(published: Path, expected: dict[str, torch.Tensor], base: Path) -> None:
    """Every published weight equals `expected`, and the round changed some of them."""
    weights, before = (
        load_file(published / "model.safetensors"),
        load_file(base / "model.safetensors"),
    )
    assert set(weights) == set(before)
    for name, tensor in weights.items():
        torch.testing.assert_close(tensor, expected[name], rtol=1e-5, atol=1e-6, msg=name)
    assert any(not torch.equal(weights[n], before[n]) for n in weights)


@pytest.mark.parametrize("adapter", ["ffa_lora", "lora", "dora"])
@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2", "mistral", "phi3", "qwen2_tied"])
def test_round_publishes_what_peft_merges(
    base_of: Callable[[str], Path], tmp_path: Path, family: str, adapter: str
) -> None:
    # Prepare
    base = base_of(family)

    # Execute
    fed, published = one_round(base, tmp_path, adapter)

    # Assert: peft's own merge of the client's adapter (A and B as trained) is what was published
    model = client_model(fed)
    assert isinstance(model, PeftModel)
    merged = model.merge_and_unload().state_dict()  # type: ignore[operator]
    assert_published_is(published, merged, base)


def test_gpt2_conv1d_orientation_on_both_sides(
    base_of: Callable[[str], Path], tokenizer: PreTrainedTokenizerBase
) -> None:
    # Prepare: GPT-2's c_attn weight is stored (in, out) = (32, 96)
    base = base_of("gpt2")
    state = load_file(base / "model.safetensors")
    linear = linear_layers_of(base)
    spec = LoraSpec(rank=4, fan_in_fan_out=frozenset(n for n, t in linear.items() if t))
    model = AutoModelForCausalLM.from_pretrained(base)

    # Execute
    ffa = update_shapes(state, adapter="ffa_lora", spec=spec)
    dense = update_shapes(state, adapter="lora", spec=spec)
    trainer = PeftTrainer(model, tokenizer, spec=LoraSpec(rank=4))

    # Assert: B is (out, r), a dense delta has the stored shape, and the client agrees
    assert linear["transformer.h.0.attn.c_attn"] and not linear["lm_head"]
    assert state["transformer.h.0.attn.c_attn.weight"].shape == (32, 96)
    assert ffa["transformer.h.0.attn.c_attn.lora_B"] == (96, 4)
    assert ffa["transformer.h.1.mlp.c_proj.lora_B"] == (32, 4)
    assert dense["transformer.h.0.attn.c_attn.weight"] == (32, 96)
    assert trainer.shapes["transformer.h.0.attn.c_attn"] == (96, 32)
    assert trainer.oriented.fan_in_fan_out == spec.fan_in_fan_out


def test_target_modules_matching_nothing_are_refused_naming_the_layers(
    base_of: Callable[[str], Path], tmp_path: Path
) -> None:
    # Prepare: a GPT-2 base asked for Llama-only names
    validation = tmp_path / "validation.jsonl"
    write_jsonl(make_examples(8, seed=99), validation)
    init_home(
        tmp_path / "home",
        tiny=False,
        base_model=base_of("gpt2"),
        validation=validation,
        settings="",
    )
    training = {"target_modules": ["q_proj", "v_proj"]}
    fed = InProcessFederation.build(
        tmp_path / "home", [make_examples(8, seed=1)], overrides={**ROUND, "training": training}
    )

    # Execute / Assert: one line that names the base's linear layers
    with pytest.raises(ValueError) as refused:
        fed.run()
    assert str(refused.value) == (
        "none of the target modules (q_proj, v_proj) is a linear layer of the base model; "
        "its linear layers are c_attn, c_fc, c_proj, lm_head: name some of these in target_modules"
    )


@pytest.mark.parametrize("family", ["qwen2_tied", "gpt2"])
def test_full_round_updates_a_tied_embedding_once(
    base_of: Callable[[str], Path], tmp_path: Path, family: str
) -> None:
    # Prepare
    base = base_of(family)
    embedding = AutoModelForCausalLM.from_pretrained(base).get_input_embeddings().weight
    name = next(
        k for k, v in load_file(base / "model.safetensors").items() if v.shape == embedding.shape
    )

    # Execute
    fed, published = one_round(base, tmp_path, "full")

    # Assert: the client's trained weights are published; the embedding moved by the client's
    # delta once, and the published model's LM head is still that embedding
    model = client_model(fed)
    (runtime,) = fed.runtimes.values()
    assert isinstance(runtime.trainer, FullTrainer) and isinstance(model, PreTrainedModel)
    assert_published_is(published, model.state_dict(), base)
    update = runtime.trainer.update()
    assert "lm_head.weight" not in update
    torch.testing.assert_close(
        load_file(published / "model.safetensors")[name], embedding.detach() + update[name]
    )
    reloaded = AutoModelForCausalLM.from_pretrained(published)
    head, embed = reloaded.get_output_embeddings().weight, reloaded.get_input_embeddings().weight
    assert head.data_ptr() == embed.data_ptr()


def test_qlora_round_on_gpt2_publishes_peft_deltas_in_the_stored_orientation(
    base_of: Callable[[str], Path], tmp_path: Path
) -> None:
    # Prepare: quantised, GPT-2's Conv1D layers become (out, in) Linear4bit modules
    base = base_of("gpt2")

    # Execute
    fed, published = one_round(base, tmp_path, "qlora")

    # Assert: published - base is peft's delta of each adapted layer, stored (in, out)
    (runtime,) = fed.runtimes.values()
    assert isinstance(runtime.trainer, PeftTrainer) and len(runtime.trainer.layers) == 8
    before, after = (
        load_file(base / "model.safetensors"),
        load_file(published / "model.safetensors"),
    )
    for name, layer in runtime.trainer.layers.items():
        delta = layer.get_delta_weight("default").float()  # (out, in)
        torch.testing.assert_close(
            after[name + ".weight"] - before[name + ".weight"], delta.T, rtol=1e-4, atol=1e-6
        )
    assert runtime.trainer.oriented.fan_in_fan_out == {
        n for n, t in linear_layers_of(base).items() if t
    }
