"""The `closeness` reward: partial credit that falls off with the distance from the answer."""

from __future__ import annotations

import itertools
import math

import pytest

from zoo_gym.core.reward_functions import CLOSENESS_SCALE, closeness


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("19", "19", 1.0),
        ("29", "19", math.exp(-1.0)),  # 10 off, one scale: 1/e
        ("9", "19", math.exp(-1.0)),  # symmetric
        ("-1", "19", math.exp(-2.0)),
        (" 18 \nbecause", "19", math.exp(-0.1)),  # only the first line counts
        ("0", "0", 1.0),
    ],
)
def test_closeness_of_integer_answers(completion: str, answer: str, expected: float) -> None:
    assert closeness(completion, answer) == pytest.approx(expected)


@pytest.mark.parametrize(
    "completion", ["", "   ", "nineteen", "19 apples", "19.0", "about 19", "\n19"]
)
def test_closeness_is_zero_without_one_integer_on_the_first_line(completion: str) -> None:
    # "\n19": the first non-blank line is read, as exact_answer does
    expected = 1.0 if completion == "\n19" else 0.0
    assert closeness(completion, "19") == expected


def test_closeness_is_zero_for_a_non_numeric_answer() -> None:
    assert closeness("19", "nineteen") == 0.0


def test_closeness_falls_strictly_with_the_distance() -> None:
    # Prepare
    answer = 50
    distances = range(0, 60, 5)

    # Execute
    scores = [closeness(str(answer + d), str(answer)) for d in distances]

    # Assert: every step further earns less, all within (0, 1]
    assert all(a > b for a, b in itertools.pairwise(scores))
    assert all(0.0 < s <= 1.0 for s in scores)
    assert scores[2] == pytest.approx(math.exp(-10 / CLOSENESS_SCALE))
