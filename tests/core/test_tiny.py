from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from zoo_gym.core.tiny import build_tiny_model, create_tiny_base, train_tiny_tokenizer

MESSAGES = [{"role": "user", "content": "What is 12 + 7?"}, {"role": "assistant", "content": "19"}]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny")
    create_tiny_base(directory, seed=0)
    return directory


def test_base_loads_through_auto_classes(base_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir)

    assert (base_dir / "model.safetensors").is_file()
    assert model.config.model_type == "qwen2"
    assert model.dtype == torch.float32
    assert model.config.hidden_size == 64 and model.config.num_hidden_layers == 2
    assert model.config.vocab_size == len(tokenizer)
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False)
    assert (
        text
        == "<|begin|><|im_start|>user\nWhat is 12 + 7?<|im_end|>\n<|im_start|>assistant\n19<|im_end|>\n"
    )
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert tokenizer.convert_ids_to_tokens(ids[-4:]) == ["1", "9", "<|im_end|>", "Ċ"]


def test_saved_tokenizer_matches_trained_one(base_dir: Path) -> None:
    trained = train_tiny_tokenizer(["What is 12 + 7?\n19", "Add 3 and 4.\n7"])
    loaded = AutoTokenizer.from_pretrained(base_dir)
    text = "Add 123 and  4.\n\n<|im_end|>"

    assert trained.pad_token == loaded.pad_token == "<|pad|>"
    assert trained.eos_token == loaded.eos_token == "<|im_end|>"
    assert trained.bos_token == loaded.bos_token == "<|begin|>"
    assert loaded.decode(loaded(text, add_special_tokens=False)["input_ids"]) == text


def test_generation_prompt(base_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(base_dir)

    prompt = tokenizer.apply_chat_template(MESSAGES[:1], tokenize=False, add_generation_prompt=True)

    assert prompt.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_build_is_seeded(arch: str) -> None:
    a = build_tiny_model(vocab_size=300, arch=arch, seed=1)
    b = build_tiny_model(vocab_size=300, arch=arch, seed=1)
    c = build_tiny_model(vocab_size=300, arch=arch, seed=2)

    assert a.config.model_type == arch
    assert a.config._attn_implementation == "sdpa"
    for name, tensor in a.state_dict().items():
        assert torch.equal(tensor, b.state_dict()[name])
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)


def test_unknown_arch() -> None:
    with pytest.raises(ValueError, match="unknown tiny architecture"):
        build_tiny_model(vocab_size=300, arch="gpt2")
