"""Built-in reward functions, their doctests, and loading by name and by import path."""

from __future__ import annotations

import doctest
import math
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import zoo_gym.client.trainers.reward_functions as reward_functions
import zoo_gym.core.reward_functions as core_rewards
from zoo_gym.client.trainers.reward_functions import (
    BUILTIN,
    RewardError,
    load_reward_functions,
)
from zoo_gym.core.protocol import BUILTIN_REWARDS


@pytest.mark.parametrize("module", [core_rewards, reward_functions])
def test_doctests_pass(module: object) -> None:
    result = doctest.testmod(module, verbose=False)  # type: ignore[arg-type]
    assert result.attempted > 0 and result.failed == 0


def test_builtins_are_exactly_the_names_a_task_may_carry() -> None:
    assert tuple(BUILTIN) == BUILTIN_REWARDS


def test_a_task_may_name_closeness() -> None:
    # Prepare / Execute
    functions = load_reward_functions(["closeness", "exact_answer"], [])

    # Assert: a near miss earns partial credit, a hit both rewards
    assert list(functions) == ["closeness", "exact_answer"]
    assert reward_functions.total_reward(functions, "21", "19") == math.exp(-0.2)
    assert reward_functions.total_reward(functions, "19", "19") == 2.0


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("19", "19", {"exact_answer": 1.0, "format": 1.0, "length": 0.0, "closeness": 1.0}),
        ("  19\n", "19", {"exact_answer": 1.0, "format": 1.0, "length": 0.0, "closeness": 1.0}),
        (
            "18",
            "19",
            {"exact_answer": 0.0, "format": 1.0, "length": 0.0, "closeness": math.exp(-0.1)},
        ),
        ("19.", "19", {"exact_answer": 0.0, "format": 0.0, "length": 0.0, "closeness": 0.0}),
        ("", "19", {"exact_answer": 0.0, "format": 0.0, "length": 0.0, "closeness": 0.0}),
        # 10 characters, allowance 2 + 4 = 6: -4/32
        (
            "19 = 12+7.",
            "19",
            {"exact_answer": 0.0, "format": 0.0, "length": -0.125, "closeness": 0.0},
        ),
        ("1" * 200, "19", {"exact_answer": 0.0, "format": 1.0, "length": -1.0, "closeness": 0.0}),
    ],
)
def test_builtin_values(completion: str, answer: str, expected: dict[str, float]) -> None:
    assert {name: f(completion, answer) for name, f in BUILTIN.items()} == expected


@pytest.fixture
def local_module(tmp_path: Path) -> Iterator[str]:
    """A contributor's own module on sys.path, as if installed in its environment."""
    name = "contributor_rewards_for_test"
    (tmp_path / f"{name}.py").write_text(
        "def shorter_is_better(completion, answer):\n"
        "    return -float(len(completion))\n\n"
        "class Scorers:\n"
        "    @staticmethod\n"
        "    def ones(completion, answer):\n"
        "        return 1.0\n\n"
        "THRESHOLD = 3\n"
    )
    sys.path.insert(0, str(tmp_path))
    try:
        yield name
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop(name, None)


def test_task_builtins_and_local_import_paths_load_in_order(local_module: str) -> None:
    functions = load_reward_functions(
        ["exact_answer", "length"],
        [f"{local_module}:shorter_is_better", f"{local_module}:Scorers.ones"],
    )

    assert list(functions) == [
        "exact_answer",
        "length",
        f"{local_module}:shorter_is_better",
        f"{local_module}:Scorers.ones",
    ]
    assert functions["exact_answer"] is BUILTIN["exact_answer"]
    assert functions[f"{local_module}:shorter_is_better"]("abcd", "19") == -4.0
    assert functions[f"{local_module}:Scorers.ones"]("abcd", "19") == 1.0


def test_a_task_cannot_name_code_that_is_not_a_builtin() -> None:
    with pytest.raises(RewardError, match=r"'os:system'.*not a built-in.*refused"):
        load_reward_functions(["exact_answer", "os:system"], [])
    with pytest.raises(RewardError, match="not a built-in"):
        load_reward_functions(["zoo_gym.core.reward_functions:exact_answer"], [])


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("no_colon_here", "not an import path; write it as 'package.module:function'"),
        (":f", "not an import path"),
        ("module_that_does_not_exist_xyz:f", "cannot import 'module_that_does_not_exist_xyz'"),
        ("{mod}:missing", "has no attribute 'missing'"),
        ("{mod}:THRESHOLD", "is a int, not a function"),
    ],
)
def test_bad_local_paths_are_refused_with_one_line(
    local_module: str, path: str, message: str
) -> None:
    with pytest.raises(RewardError, match=message) as info:
        load_reward_functions([], [path.format(mod=local_module)])
    assert "\n" not in str(info.value)


def test_no_reward_functions_at_all_is_refused() -> None:
    with pytest.raises(RewardError, match="no reward functions"):
        load_reward_functions([], [])
