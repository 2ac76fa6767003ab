"""Choosing each next token, and turning a row's tokens into text as they arrive.

Sampling follows the OpenAI parameters: ``temperature`` 0 is greedy (argmax); otherwise the
logits are divided by the temperature and, with ``top_p`` < 1, only the smallest set of tokens
whose probabilities sum to at least ``top_p`` is kept (nucleus sampling [Holtzman et al., 2020]).
Each request draws from its own generator, seeded by its ``seed`` when it has one, so a seeded
request gives the same text whatever else shares its batch.

Text is released as it becomes final: the whole completion is decoded again at each token (a
byte-level BPE token can be half a character), and text that could still turn into a stop
string, or that ends in an incomplete character, is held back until it is decided.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

REPLACEMENT = "\ufffd"  # what a decoder writes for an incomplete UTF-8 sequence


def new_generator(seed: int | None) -> torch.Generator:
    """A CPU generator seeded by `seed`, or from the OS's randomness when it is None."""
    return torch.Generator().manual_seed(seed if seed is not None else secrets.randbits(63))


def next_token(
    logits: Tensor, *, temperature: float, top_p: float, generator: torch.Generator
) -> int:
    """One token id from `logits` `(vocab,)` (float32, on the CPU).

    >>> next_token(torch.tensor([0.1, 2.0, 0.3]), temperature=0.0, top_p=1.0,
    ...            generator=new_generator(0))
    1
    """
    if temperature <= 0.0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass of the better tokens
        sorted_probs[before >= top_p] = 0.0  # the first token always stays (before = 0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """How many trailing characters of `text` may still become a stop string or a character.

    >>> held_back("the answer is 4", ("4\\n",)), held_back("abc", ("cd", "bcx")), held_back("x", ())
    (1, 2, 0)
    """
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    if text.endswith(REPLACEMENT):
        longest = max(longest, len(text) - len(text.rstrip(REPLACEMENT)))
    return longest


@dataclass
class TextStream:
    """The completion of one row: its token ids and how much of its text was released."""

    tokenizer: Any
    stops: tuple[str, ...]
    ids: list[int] = field(default_factory=list)
    sent: int = 0  # characters released

    def push(self, token: int) -> tuple[str, bool]:
        """Add `token`; the text now final, and whether a stop string ended the completion
        (the stop string itself is never released)."""
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        found = [
            i for i in (text.find(s, max(0, self.sent - len(s))) for s in self.stops) if i >= 0
        ]
        if found:
            return self._release(text[: min(found)]), True
        return self._release(text[: len(text) - held_back(text, self.stops)]), False

    def rest(self) -> str:
        """Everything not yet released (the completion ended without a stop string)."""
        return self._release(self.tokenizer.decode(self.ids, skip_special_tokens=True))

    def _release(self, upto: str) -> str:
        if len(upto) <= self.sent:
            return ""
        new, self.sent = upto[self.sent :], len(upto)
        return new
