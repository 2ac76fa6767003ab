"""A synthetic instruction task that a tiny model learns in seconds.

Two-operand addition, asked in a few phrasings: ``"What is 12 + 7?"`` -> ``"19"``.
Digits are single tokens in the tiny tokenizer, the answer is short, and the
reward is exact match, so the task serves SFT (validation loss) and GRPO (mean
reward) alike. Records are Alpaca ``{"instruction", "input", "output"}``.

`TASKS` names the tasks an attack matrix can split non-IID (`zoo_gym.core.partition`), each
with what its classes are: for ``addition`` the answer's tens digit (0-9), for ``arithmetic``
the operation (add, subtract, multiply, compare), four tasks in one whose honest updates
pull in different directions when each contributor holds only some of them.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
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


# The arithmetic task: one class per operation. The tiny tokenizer (trained on the addition
# task's text) is byte-level: "-", "*", "<" are single tokens, "yes" / "no" two or three.
OPERATIONS = ("add", "subtract", "multiply", "compare")
ARITHMETIC_MAX_OPERAND = 9  # 100 facts per operation: a tiny model learns them over rounds
_OPERATION_PHRASINGS = ("What is {a} {op} {b}?", "Compute {a} {op} {b}.")


def operation_example(operation: int, rng: random.Random) -> Record:
    """One record of `OPERATIONS[operation]` on operands 0..ARITHMETIC_MAX_OPERAND:
    ``"What is 2 - 7?"`` -> ``"-5"``, ``"Compute 3 * 4."`` -> ``"12"``, ``"Is 8 < 7?"`` -> ``"no"``."""
    a, b = rng.randint(0, ARITHMETIC_MAX_OPERAND), rng.randint(0, ARITHMETIC_MAX_OPERAND)
    name = OPERATIONS[operation]
    if name == "compare":
        return {"instruction": f"Is {a} < {b}?", "input": "", "output": "yes" if a < b else "no"}
    symbol, value = {"add": ("+", a + b), "subtract": ("-", a - b), "multiply": ("*", a * b)}[name]
    question = rng.choice(_OPERATION_PHRASINGS).format(a=a, op=symbol, b=b)
    return {"instruction": question, "input": "", "output": str(value)}


def operation_of(record: Record) -> int:
    """The class of an arithmetic record: the index of its operation in `OPERATIONS`.

    >>> operation_of({"instruction": "Compute 3 * 4.", "input": "", "output": "12"})
    2
    """
    question = record["instruction"]
    if question.startswith("Is "):
        return OPERATIONS.index("compare")
    for index, symbol in ((0, " + "), (1, " - "), (2, " * ")):
        if symbol in question:
            return index
    raise ValueError(f"not an arithmetic record: {question!r}")


def addition_example(bucket: int, rng: random.Random) -> Record:
    """One addition record whose answer lies in 10 * bucket .. 10 * bucket + 9 (drawn as
    `make_examples` draws, kept only in that bucket)."""
    while True:
        a, b = rng.randint(0, MAX_OPERAND), rng.randint(0, MAX_OPERAND)
        if (a + b) // 10 == bucket:
            question = rng.choice(_PHRASINGS).format(a=a, b=b)
            return {"instruction": question, "input": "", "output": str(a + b)}


def sum_bucket(record: Record) -> int:
    """The class of an addition record: its answer's tens digit.

    >>> sum_bucket({"instruction": "What is 40 + 7?", "input": "", "output": "47"})
    4
    """
    return int(answer_of(record)) // 10


def _bucket_prior() -> tuple[float, ...]:
    pairs = [(a + b) // 10 for a in range(MAX_OPERAND + 1) for b in range(MAX_OPERAND + 1)]
    return tuple(pairs.count(k) / len(pairs) for k in range(max(pairs) + 1))


@dataclass(frozen=True)
class Task:
    """A synthetic task split by class: what a class is, how often it occurs, how to draw one."""

    name: str
    classes: tuple[str, ...]  # what each label means
    prior: tuple[float, ...]  # share of each class in IID records
    example: Callable[[int, random.Random], Record]  # (class, rng) -> record
    label: Callable[[Record], int]

    def examples(self, n: int, *, seed: int) -> list[Record]:
        """`n` IID records: classes drawn by the prior (addition: exactly `make_examples`)."""
        if self.name == "addition":
            return make_examples(n, seed=seed)
        rng = random.Random(seed)
        classes = rng.choices(range(len(self.classes)), weights=self.prior, k=n)
        return [self.example(c, rng) for c in classes]

    def balanced(self, n: int, *, seed: int) -> list[Record]:
        """`n` records, the classes as equal as `n` allows, in a shuffled order (a validation
        split that weighs every class alike)."""
        rng = random.Random(seed)
        classes = [i % len(self.classes) for i in range(n)]
        rng.shuffle(classes)
        return [self.example(c, rng) for c in classes]


TASKS = {
    "addition": Task(
        "addition",
        tuple(f"answer {10 * k}-{10 * k + 9}" for k in range(len(_bucket_prior()))),
        _bucket_prior(),
        addition_example,
        sum_bucket,
    ),
    "arithmetic": Task(
        "arithmetic",
        OPERATIONS,
        tuple(1 / len(OPERATIONS) for _ in OPERATIONS),
        operation_example,
        operation_of,
    ),
}
