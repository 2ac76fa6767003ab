"""Validation utility on the coordinator's private validation set.

One model is loaded once and receives candidate weights in place, so scoring a
round costs a forward pass over the validation set, not a model load. `editing` hands
out that model's own weights with a state loaded, for an update to be merged into
them in place: a candidate is evaluated without a second copy of the model. Utility is
minus the validation loss for SFT and the mean reward of greedy completions for
GRPO / GSPO (DESIGN "Quality and rewards"). The model lives on the coordinator's `device`
(CUDA when it has one); `subset` restricts the records a round's scoring evaluates on and
`loss_gradient` is the one backward pass of first-order scoring.
"""

from __future__ import annotations

import copy
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
    collate,
    completion_mask,
    completion_nll,
    encode_conversation,
    encode_prompt,
    left_pad,
    pad_id_of,
    prompts_from_conversations,
    to_conversation,
)
from zoo_gym.core.evaluate import rows_per_batch, validation_loss
from zoo_gym.core.reward_functions import BUILTIN


class Evaluator:
    def __init__(
        self,
        model_dir: Path,
        validation_data: Path,
        *,
        max_length: int = 96,
        device: torch.device | str = "cpu",
    ) -> None:
        self.device = torch.device(device)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model = model.to(self.device)  # type: ignore[arg-type]
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

    def subset(self, indices: Sequence[int]) -> Evaluator:
        """This evaluator on the records at `indices` only: the same model, tokenizer and lock
        (one model in memory), its own prompts."""
        view = copy.copy(self)
        view.records = [self.records[i] for i in indices]
        for cached in ("prompts", "_encoded_prompts"):
            view.__dict__.pop(cached, None)
        return view

    def load(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load `state_dict` (some or all of the weights) into the model."""
        with self.lock:
            self._load(state_dict)

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

    def loss_gradient(
        self,
        state_dict: dict[str, torch.Tensor],
        names: Sequence[str],
        *,
        batch_size: int | None = None,
    ) -> tuple[float, dict[str, torch.Tensor]]:
        """`loss` of the model with `state_dict` loaded and its gradient with respect to the
        weights `names` (state-dict names; each gradient has its weight's stored shape and lies
        on the evaluator's device).

        One forward and backward pass over the records in batches of `batch_size` (by default
        as many as `rows_per_batch` allows), in eval mode; only the named weights track
        gradients. The model's `requires_grad` flags and mode are restored and no gradient is
        left on it.
        """
        with self.lock:
            self._load(state_dict)
            tensors = self.model.state_dict(keep_vars=True)
            unknown = [name for name in names if name not in tensors]
            if unknown:
                raise ValueError(f"loss_gradient: {unknown[0]} is not a weight of the model")
            wanted = {name: tensors[name] for name in names}
            tracked = {id(w) for w in wanted.values()}
            flags = {p: p.requires_grad for p in self.model.parameters()}
            was_training = self.model.training
            try:
                for p in self.model.parameters():
                    p.requires_grad_(id(p) in tracked)
                    p.grad = None
                self.model.eval()
                total, count = self._backward(batch_size)
                grads = {
                    name: torch.zeros_like(w) if w.grad is None else w.grad.detach() / count
                    for name, w in wanted.items()
                }
            finally:
                for p, flag in flags.items():
                    p.grad = None
                    p.requires_grad_(flag)
                self.model.train(was_training)
        return total / count, grads

    def _backward(self, batch_size: int | None) -> tuple[float, int]:
        """Backpropagate the summed completion NLL of every record; (sum, completion tokens)."""
        pad_id = pad_id_of(self.tokenizer)
        examples = [
            encode_conversation(self.tokenizer, r, max_length=self.max_length) for r in self.records
        ]
        if batch_size is None:
            batch_size = rows_per_batch(self.model, max(len(ids) for ids, _ in examples))
        total, count = 0.0, 0
        for start in range(0, len(examples), batch_size):
            batch = collate(examples[start : start + batch_size], pad_id=pad_id)
            nll, n = completion_nll(self.model, batch.to(self.device))
            nll.backward()  # type: ignore[no-untyped-call]
            total += float(nll.detach())
            count += n
        if count == 0:
            raise ValueError(f"no completion tokens left within max_length={self.max_length}")
        return total, count

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
                ids, mask = ids.to(self.device), mask.to(self.device)
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
