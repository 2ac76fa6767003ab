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


@torch.no_grad()
def validation_loss(
    model: nn.Module,
    tokenizer: Any,
    records: Sequence[Mapping[str, Any] | Conversation],
    *,
    max_length: int = 128,
    batch_size: int = 16,
) -> float:
    """Mean next-token NLL (nats) over the assistant tokens of `records`.

    Records may be Alpaca, ShareGPT, ``messages`` dicts or `Conversation` lists.
    Runs in eval mode without gradients and restores the model's mode after.
    """
    examples = [
        encode_conversation(tokenizer, to_conversation(r), max_length=max_length) for r in records
    ]
    if not examples:
        raise ValueError("validation_loss needs at least one record")
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
