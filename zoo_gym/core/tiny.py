"""Tiny models built from a config, for tests and the local demo.

No weights are downloaded: the tokenizer is trained here with `tokenizers`
(byte-level BPE [Sennrich et al., 2016] with one token per digit) and the model
is a randomly initialised Qwen2 [Yang et al., 2024] or Llama [Touvron et al.,
2023] with hidden size 64. `create_tiny_base` writes both with `save_pretrained`,
so they load through `AutoModelForCausalLM` / `AutoTokenizer` like any Hugging
Face model.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
)
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX, Qwen2Tokenizer

from zoo_gym.core import synthetic

logger = logging.getLogger(__name__)

BOS, EOS, PAD, IM_START = "<|begin|>", "<|im_end|>", "<|pad|>", "<|im_start|>"

# ChatML, as used by Qwen2 instruct models.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

ARCHITECTURES = ("qwen2", "llama")


def train_tiny_tokenizer(texts: Iterable[str], *, vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on `texts`, with ChatML special tokens and template.

    The pipeline (NFC, Qwen2's pre-tokenisation regex with one token per digit,
    byte-level BPE) is exactly the one `Qwen2Tokenizer` rebuilds on load, so the
    saved tokenizer round-trips through `AutoTokenizer` for either architecture.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, BOS, EOS, IM_START],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    roles = ["system\n", "user\n", "assistant\n"] * 100
    tokenizer.train_from_iterator([*texts, *roles], trainer=trainer)
    bpe = json.loads(tokenizer.to_str())["model"]
    return Qwen2Tokenizer(
        vocab=bpe["vocab"],
        merges=[tuple(merge) for merge in bpe["merges"]],  # type: ignore[misc]
        unk_token=None,  # type: ignore[arg-type]
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        extra_special_tokens=[IM_START],
        chat_template=CHAT_TEMPLATE,
        model_max_length=256,
    )


def tiny_config(*, vocab_size: int, arch: str = "qwen2") -> PretrainedConfig:
    """Config of the tiny model: hidden 64, 2 layers, 4 heads, 2 KV heads, MLP 128."""
    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        dtype="float32",
    )
    if arch == "qwen2":
        return Qwen2Config(**common)  # type: ignore[arg-type]
    if arch == "llama":
        return LlamaConfig(**common)  # type: ignore[arg-type]
    raise ValueError(f"unknown tiny architecture {arch!r}; choose one of {ARCHITECTURES}")


def build_tiny_model(*, vocab_size: int, arch: str = "qwen2", seed: int = 0) -> PreTrainedModel:
    """Randomly initialised tiny causal LM (float32, SDPA attention), reproducible under `seed`."""
    config = tiny_config(vocab_size=vocab_size, arch=arch)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
            config, attn_implementation="sdpa", dtype=torch.float32
        )
    assert isinstance(model, PreTrainedModel)
    return model


def pretrain(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    texts: list[str],
    *,
    steps: int,
    batch_size: int = 32,
    lr: float = 3e-3,
    seed: int = 0,
) -> float:
    """Plain next-token pretraining on `texts` (full fine-tuning, AdamW, cosine decay).

    Returns the mean loss of the last 10 steps.
    """
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * s / steps))
    )
    model.train()
    losses: list[float] = []
    for _ in range(steps):
        rows = torch.randint(len(texts), (batch_size,), generator=generator).tolist()
        batch = tokenizer(
            [tokenizer.bos_token + texts[r] + tokenizer.eos_token for r in rows],
            add_special_tokens=False,
            padding=True,
            return_tensors="pt",
        )
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        loss = model(**batch, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
    model.eval()  # type: ignore[no-untyped-call]
    return sum(losses[-10:]) / len(losses[-10:])


def task_tokenizer(*, seed: int = 0) -> PreTrainedTokenizerFast:
    """The tiny models' tokenizer: `train_tiny_tokenizer` on the synthetic task's text (records
    and pretraining corpus drawn under `seed`)."""
    records = synthetic.make_examples(2000, seed=seed + 10_000)
    corpus = synthetic.pretraining_text(4000, seed=seed + 20_000)
    return train_tiny_tokenizer([r["instruction"] + "\n" + r["output"] for r in records] + corpus)


def create_tiny_base(
    directory: Path, *, seed: int = 0, arch: str = "qwen2", pretrain_steps: int = 150
) -> None:
    """Write a tiny base model and its tokenizer to `directory` (safetensors).

    The tokenizer is trained on the synthetic task's text; the model gets
    `pretrain_steps` of plain-text pretraining on arithmetic facts, so it is a
    "base model" that knows the facts but not the chat format.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    corpus = synthetic.pretraining_text(4000, seed=seed + 20_000)
    tokenizer = task_tokenizer(seed=seed)
    model = build_tiny_model(vocab_size=len(tokenizer), arch=arch, seed=seed)
    if pretrain_steps:
        loss = pretrain(model, tokenizer, corpus, steps=pretrain_steps, seed=seed)
        logger.info("tiny base pretrained for %d steps, loss %.3f", pretrain_steps, loss)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
