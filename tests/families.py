"""Tiny models of real Hugging Face families, for tests that must not assume one architecture.

Each is a randomly initialised causal LM of hidden size 32 and 2 layers, saved with the
project's locally trained tokenizer (`zoo_gym.core.tiny.task_tokenizer`) so that it loads
through the Auto classes and a coordinator home can be made from its directory:

- ``gpt2``: transformers' ``Conv1D`` layers (weights stored `(in, out)`: ``c_attn``, ``c_proj``,
  ``c_fc``), embeddings tied to the LM head;
- ``llama``, ``qwen2`` (biased q/k/v), ``mistral``: separate q/k/v and gate/up projections;
- ``phi3``: fused ``qkv_proj`` and ``gate_up_proj``;
- ``qwen2_tied``: Qwen2 with ``tie_word_embeddings=True`` (one stored embedding matrix).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    PretrainedConfig,
    PreTrainedTokenizerBase,
    Qwen2Config,
)

# pad, bos and eos are the first three tokens of `train_tiny_tokenizer`
SPECIAL = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
DECODER = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
    **SPECIAL,
}


def _gpt2(vocab_size: int) -> PretrainedConfig:
    return GPT2Config(
        vocab_size=vocab_size, n_embd=32, n_layer=2, n_head=2, n_positions=128, **SPECIAL
    )


def _decoder(config: type[PretrainedConfig], **extra: Any) -> Callable[[int], PretrainedConfig]:
    return lambda vocab_size: config(vocab_size=vocab_size, **{**DECODER, **extra})


FAMILIES: dict[str, Callable[[int], PretrainedConfig]] = {
    "gpt2": _gpt2,
    "llama": _decoder(LlamaConfig),
    "qwen2": _decoder(Qwen2Config),
    "mistral": _decoder(MistralConfig),
    "phi3": _decoder(Phi3Config),
    "qwen2_tied": _decoder(Qwen2Config, tie_word_embeddings=True),
}


def save_family(
    family: str, directory: Path, tokenizer: PreTrainedTokenizerBase, *, seed: int = 0
) -> Path:
    """Write a tiny random `family` model (float32 safetensors, config) and `tokenizer` to
    `directory`; returns it."""
    config = FAMILIES[family](len(tokenizer))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
