"""Built-in reward functions for GRPO / GSPO, shared by contributors and the coordinator.

Each is a tiny pure function ``(completion, answer) -> float`` in the style of
TRL's reward functions. A round's reward is the sum of the functions the task
names (`zoo_gym.core.protocol.BUILTIN_REWARDS`); the coordinator scores a model
with the same sum (DESIGN "Quality and rewards": utility = mean reward for GRPO).
They live in `core` because both sides use them and neither may import the other.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping

from zoo_gym.core.synthetic import exact_match_reward

RewardFunction = Callable[[str, str], float]

LENGTH_SLACK = 4  # characters a completion may run past its answer before `length` penalises
LENGTH_SCALE = 32  # characters of excess at which `length` reaches its floor of -1.0
CLOSENESS_SCALE = 10.0  # distance from the answer at which `closeness` falls to 1/e
_NUMBER = re.compile(r"-?\d+")


def exact_answer(completion: str, answer: str) -> float:
    """1.0 if the completion's first line is the answer (whitespace ignored), else 0.0.

    >>> exact_answer("19", "19")
    1.0
    >>> exact_answer(" 19\\nbecause 12 + 7 = 19", "19")
    1.0
    >>> exact_answer("18", "19")
    0.0
    """
    return exact_match_reward(completion, answer)


def format(completion: str, answer: str) -> float:  # the name a task config uses
    """1.0 if the completion is one bare integer on one line (right or wrong), else 0.0.

    >>> format("42", "19")
    1.0
    >>> format(" -3 ", "19")
    1.0
    >>> format("19 apples", "19")
    0.0
    >>> format("19\\n19", "19")
    0.0
    """
    return 1.0 if _NUMBER.fullmatch(completion.strip()) else 0.0


def length(completion: str, answer: str) -> float:
    """0.0 up to ``len(answer) + LENGTH_SLACK`` characters, then -1/32 per extra character, floor -1.0.

    Penalises rambling without rewarding an empty reply.

    >>> length("19", "19")
    0.0
    >>> length("19 is the sum", "19")  # 13 characters, 7 past the allowance of 6
    -0.21875
    >>> length("x" * 100, "19")
    -1.0
    """
    excess = len(completion.strip()) - (len(answer.strip()) + LENGTH_SLACK)
    return -min(1.0, excess / LENGTH_SCALE) if excess > 0 else 0.0


def closeness(completion: str, answer: str) -> float:
    """Partial credit for a numeric answer: exp(-|predicted - answer| / CLOSENESS_SCALE).

    ``predicted`` is the completion's first line read as one integer; a first line that is
    not one integer (or an answer that is not one) earns 0.0. Unlike `exact_answer`, a
    near miss earns almost as much as a hit, so a model that is rarely exactly right still
    sees which of its completions are better: a dense signal for GRPO's group advantages.

    >>> closeness("19", "19")
    1.0
    >>> round(closeness(" 29\\nor so", "19"), 4)  # 10 off: exp(-1)
    0.3679
    >>> closeness("nineteen", "19")
    0.0
    >>> closeness("", "19")
    0.0
    """
    lines = completion.strip().splitlines()
    first = lines[0].strip() if lines else ""
    if not (_NUMBER.fullmatch(first) and _NUMBER.fullmatch(answer.strip())):
        return 0.0
    return math.exp(-abs(int(first) - int(answer.strip())) / CLOSENESS_SCALE)


BUILTIN: dict[str, RewardFunction] = {
    "exact_answer": exact_answer,
    "format": format,
    "length": length,
    "closeness": closeness,
}
"""The reward functions a task may name, by name."""


def total_reward(functions: Mapping[str, RewardFunction], completion: str, answer: str) -> float:
    """Sum of `functions` on one completion.

    >>> total_reward(BUILTIN, "19", "19")
    3.0
    """
    return float(sum(f(completion, answer) for f in functions.values()))
