"""A synthetic instruction task that a tiny model learns in seconds.

Two-operand addition, asked in a few phrasings: ``"What is 12 + 7?"`` -> ``"19"``.
Digits are single tokens in the tiny tokenizer, the answer is short, and the
reward is exact match, so the task serves SFT (validation loss) and GRPO (mean
reward) alike. Records are Alpaca ``{"instruction", "input", "output"}``.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

Record = dict[str, str]

MAX_OPERAND = 49
_PHRASINGS = (
    "What is {a} + {b}?",
    "Compute {a} + {b}.",
    "Add {a} and {b}.",
    "What is the sum of {a} and {b}?",
)


def make_examples(n: int, *, seed: int) -> list[Record]:
    """`n` addition records, reproducible under `seed`."""
    rng = random.Random(seed)
    records: list[Record] = []
    for _ in range(n):
        a, b = rng.randint(0, MAX_OPERAND), rng.randint(0, MAX_OPERAND)
        question = rng.choice(_PHRASINGS).format(a=a, b=b)
        records.append({"instruction": question, "input": "", "output": str(a + b)})
    return records


def pretraining_text(n: int, *, seed: int) -> list[str]:
    """Plain (non-chat) lines of the same arithmetic facts, for a short base pretraining."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        a, b = rng.randint(0, MAX_OPERAND), rng.randint(0, MAX_OPERAND)
        lines.append(f"{a} + {b} = {a + b}.")
    return lines


def answer_of(record: Record) -> str:
    """The reference answer of a record."""
    return record["output"].strip()


def exact_match_reward(completion: str, answer: str) -> float:
    """1.0 if the completion's first line is the answer (whitespace ignored), else 0.0.

    >>> exact_match_reward(" 19\\n", "19")
    1.0
    >>> exact_match_reward("19 apples", "19")
    0.0
    >>> exact_match_reward("", "19")
    0.0
    """
    lines = completion.strip().splitlines()
    return 1.0 if lines and lines[0].strip() == answer.strip() else 0.0


def write_jsonl(records: Iterable[dict[str, Any]], path: Path) -> None:
    """Write one JSON object per line (UTF-8)."""
    with Path(path).open("w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")


def shard(records: Sequence[Record], k: int) -> list[list[Record]]:
    """Split `records` into `k` disjoint, near-equal shards (round robin), one per client."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    return [list(records[i::k]) for i in range(k)]


def to_sharegpt(record: Record) -> dict[str, list[dict[str, str]]]:
    """The same example in ShareGPT format (``{"conversations": [{"from", "value"}]}``)."""
    prompt = record["instruction"]
    if record.get("input", "").strip():
        prompt = f"{prompt}\n\n{record['input']}"
    return {
        "conversations": [
            {"from": "human", "value": prompt},
            {"from": "gpt", "value": record["output"]},
        ]
    }
