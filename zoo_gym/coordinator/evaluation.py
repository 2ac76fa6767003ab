"""Validation utility on the coordinator's private validation set.

One model is loaded once and receives candidate weights in place, so scoring a
round costs a forward pass over the validation set, not a model load.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from zoo_gym.core.chat import to_conversation
from zoo_gym.core.evaluate import validation_loss


class Evaluator:
    def __init__(self, model_dir: Path, validation_data: Path, *, max_length: int = 96) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        try:
            lines = validation_data.read_text().splitlines()
            self.records = [to_conversation(json.loads(line)) for line in lines if line.strip()]
        except (OSError, ValueError) as exc:
            raise ValueError(f"validation set {validation_data} is unreadable: {exc}") from None
        if not self.records:
            raise ValueError(f"validation set {validation_data} is empty; it needs Alpaca/ShareGPT JSONL records")
        self.max_length = max_length
        self.lock = threading.Lock()

    def loss(self, state_dict: dict[str, torch.Tensor]) -> float:
        """Mean completion-token NLL of the model with `state_dict` loaded."""
        with self.lock:
            self.model.load_state_dict(state_dict, strict=False)
            return validation_loss(self.model, self.tokenizer, self.records, max_length=self.max_length)
