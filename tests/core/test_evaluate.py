import math
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from zoo_gym.core import synthetic
from zoo_gym.core.chat import IGNORE_INDEX, encode_conversation, to_conversation
from zoo_gym.core.evaluate import rows_per_batch, validation_loss
from zoo_gym.core.tiny import build_tiny_model, create_tiny_base


@pytest.fixture(scope="module")
def base(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    directory: Path = tmp_path_factory.mktemp("tiny")
    create_tiny_base(directory, pretrain_steps=0)
    return AutoModelForCausalLM.from_pretrained(directory), AutoTokenizer.from_pretrained(directory)


def test_labels_cover_exactly_the_assistant_reply(
    base: tuple[PreTrainedModel, PreTrainedTokenizerBase],
) -> None:
    _, tokenizer = base
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 1 + 2?"},
        {"role": "assistant", "content": "3"},
        {"role": "user", "content": "And 2 + 2?"},
        {"role": "assistant", "content": "4"},
    ]

    ids, labels = encode_conversation(tokenizer, conversation, max_length=256)

    assert (
        ids
        == tokenizer(
            tokenizer.apply_chat_template(conversation, tokenize=False), add_special_tokens=False
        )["input_ids"]
    )
    trained = [tokenizer.decode([t]) for t in labels if t != IGNORE_INDEX]
    assert trained == ["3", "<|im_end|>", "\n", "4", "<|im_end|>", "\n"]
    assert encode_conversation(tokenizer, conversation, max_length=5) == (ids[:5], labels[:5])


def test_validation_loss_matches_a_direct_computation(
    base: tuple[PreTrainedModel, PreTrainedTokenizerBase],
) -> None:
    model, tokenizer = base
    records = synthetic.make_examples(5, seed=0)
    model.train()

    loss = validation_loss(model, tokenizer, records, batch_size=2)

    assert model.training
    total, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for record in records:
            ids, labels = encode_conversation(tokenizer, to_conversation(record), max_length=128)
            logits = model(input_ids=torch.tensor([ids])).logits[0]
            for position in range(1, len(ids)):
                if labels[position] != IGNORE_INDEX:
                    total -= float(torch.log_softmax(logits[position - 1], -1)[labels[position]])
                    count += 1
    assert count == sum(len(r["output"]) + 2 for r in records)
    assert loss == pytest.approx(total / count, rel=1e-5)
    # Random init over a vocabulary of V tokens: about ln V.
    assert abs(loss - math.log(len(tokenizer))) < 1.0


def test_validation_loss_accepts_every_format(
    base: tuple[PreTrainedModel, PreTrainedTokenizerBase],
) -> None:
    model, tokenizer = base
    record = synthetic.make_examples(1, seed=1)[0]

    losses = [
        validation_loss(model, tokenizer, [r])
        for r in (
            record,
            synthetic.to_sharegpt(record),
            {"messages": to_conversation(record)},
            to_conversation(record),
        )
    ]

    assert max(losses) - min(losses) < 1e-9


def test_validation_loss_needs_records(
    base: tuple[PreTrainedModel, PreTrainedTokenizerBase],
) -> None:
    model, tokenizer = base

    with pytest.raises(ValueError, match="at least one"):
        validation_loss(model, tokenizer, [])


def test_batches_are_sized_by_the_logits_they_make() -> None:
    # Prepare: Qwen2.5's vocabulary and the tiny one (64 x 4 bytes x 3 per token)
    big = torch.nn.Module()
    big.config = type("Config", (), {"vocab_size": 151_936})()  # type: ignore[assignment]
    tiny = build_tiny_model(vocab_size=64)

    # Execute / Assert: 256 MiB / (3 x 4 x 151,936 x 96) = 1.53 rows; the tiny model is capped
    assert rows_per_batch(big, 96) == 1
    assert rows_per_batch(big, 24) == 6
    assert rows_per_batch(tiny, 96) == 16
    assert rows_per_batch(tiny, 96, most=4) == 4
