"""Validation loss of a causal LM on held-out instruction records.

Utility for SFT is minus this loss (see DESIGN "Quality and rewards"). It uses
the trainer's tokenisation (`zoo_gym.core.chat.encode_conversation`), so the
coordinator scores exactly the tokens a contributor trained on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from zoo_gym.core.chat import (
    Conversation,
    collate,
    completion_nll,
    encode_conversation,
    pad_id_of,
    to_conversation,
)

LOGITS_BUDGET = 256 * 2**20
"""Bytes the logits of one evaluation batch may take (float32 logits, the copy the loss
makes of them and its log-softmax: three times batch x length x vocabulary x 4 bytes)."""


def rows_per_batch(model: nn.Module, length: int, *, most: int = 16) -> int:
    """How many sequences of `length` tokens one batch holds within `LOGITS_BUDGET` (at least
    one, at most `most`): a 151,936-token vocabulary at 96 tokens is 175 MiB of logits a row."""
    found: Any = model
    head = found.get_output_embeddings() if hasattr(found, "get_output_embeddings") else None
    vocab = int(head.weight.shape[0]) if head is not None else int(found.config.vocab_size)
    return max(1, min(most, LOGITS_BUDGET // (3 * 4 * vocab * max(length, 1))))


@torch.no_grad()
def validation_loss(
    model: nn.Module,
    tokenizer: Any,
    records: Sequence[Mapping[str, Any] | Conversation],
    *,
    max_length: int = 128,
    batch_size: int | None = None,
) -> float:
    """Mean next-token NLL (nats) over the assistant tokens of `records`.

    Records may be Alpaca, ShareGPT, ``messages`` dicts or `Conversation` lists.
    Runs in eval mode without gradients and restores the model's mode after. Batches
    hold `batch_size` records, by default as many as `rows_per_batch` allows.
    """
    examples = [
        encode_conversation(tokenizer, to_conversation(r), max_length=max_length) for r in records
    ]
    if not examples:
        raise ValueError("validation_loss needs at least one record")
    if batch_size is None:
        batch_size = rows_per_batch(model, max(len(ids) for ids, _ in examples))
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        for start in range(0, len(examples), batch_size):
            batch = collate(examples[start : start + batch_size], pad_id=pad_id_of(tokenizer))
            nll, n = completion_nll(model, batch.to(device))
            total += float(nll)
            count += n
    finally:
        model.train(was_training)
    if count == 0:
        raise ValueError(f"no completion tokens left within max_length={max_length}")
    return total / count
