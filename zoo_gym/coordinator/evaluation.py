"""Validation utility on the coordinator's private validation set.

One model is loaded once and receives candidate weights in place, so scoring a
round costs a forward pass over the validation set, not a model load. `editing` hands
out that model's own weights with a state loaded, for an update to be merged into
them in place: a candidate is evaluated without a second copy of the model. Utility is
minus the validation loss for SFT and the mean reward of greedy completions for
GRPO / GSPO (DESIGN "Quality and rewards").
"""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from zoo_gym.core.chat import (
    Prompt,
    completion_mask,
    encode_prompt,
    left_pad,
    pad_id_of,
    prompts_from_conversations,
    to_conversation,
)
from zoo_gym.core.evaluate import validation_loss
from zoo_gym.core.reward_functions import BUILTIN


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
            raise ValueError(
                f"validation set {validation_data} is empty; it needs Alpaca/ShareGPT JSONL records"
            )
        self.max_length = max_length
        self.lock = threading.RLock()

    @contextmanager
    def editing(self, state_dict: dict[str, torch.Tensor]) -> Iterator[dict[str, torch.Tensor]]:
        """The model's own weights (name -> tensor, float32) with `state_dict` loaded, to be
        changed in place; inside the block, `loss(None)` and the reward methods with None
        evaluate them as they stand. Other threads wait until the block ends."""
        with self.lock:
            self.model.load_state_dict(state_dict, strict=False)
            yield dict(self.model.state_dict())

    def _load(self, state_dict: dict[str, torch.Tensor] | None) -> None:
        if state_dict is not None:
            self.model.load_state_dict(state_dict, strict=False)

    def loss(self, state_dict: dict[str, torch.Tensor] | None) -> float:
        """Mean completion-token NLL of the model with `state_dict` loaded (None: as it is)."""
        with self.lock:
            self._load(state_dict)
            return validation_loss(
                self.model, self.tokenizer, self.records, max_length=self.max_length
            )

    def mean_reward(
        self,
        state_dict: dict[str, torch.Tensor] | None,
        *,
        reward_functions: Sequence[str],
        max_new_tokens: int,
        batch_size: int = 64,
    ) -> float:
        """Mean over the validation prompts of the summed built-in rewards of the greedy completion.

        Each record's prompt is its conversation up to the last assistant turn and its answer
        that turn, as on the contributors. Greedy decoding makes the score deterministic.
        """
        means = self.mean_rewards(
            state_dict,
            reward_functions=reward_functions,
            max_new_tokens=max_new_tokens,
            batch_size=batch_size,
        )
        return sum(means.values())

    def mean_rewards(
        self,
        state_dict: dict[str, torch.Tensor] | None,
        *,
        reward_functions: Sequence[str],
        max_new_tokens: int,
        batch_size: int = 64,
    ) -> dict[str, float]:
        """`mean_reward` of each function on its own, from one greedy generation."""
        unknown = [name for name in reward_functions if name not in BUILTIN]
        if unknown or not reward_functions:
            raise ValueError(
                f"reward_functions must name built-ins ({', '.join(BUILTIN)}), got {list(reward_functions)}"
            )
        functions = {name: BUILTIN[name] for name in reward_functions}
        texts = self.completions(state_dict, max_new_tokens=max_new_tokens, batch_size=batch_size)
        totals = dict.fromkeys(functions, 0.0)
        for text, (_, answer) in zip(texts, self.prompts, strict=True):
            for name, function in functions.items():
                totals[name] += function(text, answer)
        return {name: total / len(texts) for name, total in totals.items()}

    @functools.cached_property
    def prompts(self) -> list[Prompt]:
        """(conversation up to the last assistant turn, that turn) of each validation record."""
        return prompts_from_conversations(self.records)

    @functools.cached_property
    def _encoded_prompts(self) -> list[list[int]]:
        return [encode_prompt(self.tokenizer, prompt) for prompt, _ in self.prompts]

    def completions(
        self,
        state_dict: dict[str, torch.Tensor] | None,
        *,
        max_new_tokens: int,
        batch_size: int = 64,
    ) -> list[str]:
        """The greedy completion of each validation prompt, in batches left-padded as on clients."""
        if not self.prompts:
            raise ValueError(
                "no validation record has an assistant turn to score; rewards need answers"
            )
        pad_id = pad_id_of(self.tokenizer)
        eos_id = self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else pad_id
        room = max(1, self.max_length - max_new_tokens)
        encoded = [ids[-room:] for ids in self._encoded_prompts]
        texts: list[str] = []
        model: Any = self.model
        with self.lock, torch.no_grad():
            self._load(state_dict)
            model.eval()
            for start in range(0, len(encoded), batch_size):
                ids, mask = left_pad(encoded[start : start + batch_size], pad_id)
                width = ids.shape[1]
                out = model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    do_sample=False,
                    max_new_tokens=max_new_tokens,
                    pad_token_id=pad_id,
                    eos_token_id=eos_id,
                )
                completions = out[:, width:]
                kept = completion_mask(completions, eos_id)
                texts += [
                    str(self.tokenizer.decode(row[m].tolist(), skip_special_tokens=True))
                    for row, m in zip(completions, kept, strict=True)
                ]
        return texts
