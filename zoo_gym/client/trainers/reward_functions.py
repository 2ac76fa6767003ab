"""Reward functions for GRPO / GSPO: the built-ins and the contributor's own.

A reward function is a pure ``(completion: str, answer: str) -> float``. The
built-ins (`exact_answer`, `format`, `length`, `closeness`, defined in `zoo_gym.core.reward_functions`
so the coordinator scores with the same code) are the only names a round's task
may carry. A contributor adds its own by import path (``"package.module:function"``)
in its client config; those modules come from the contributor's own installation.
No code ever arrives over the wire: a task naming anything but a built-in is refused.

>>> functions = load_reward_functions(["exact_answer", "format"], [])
>>> sorted(functions)
['exact_answer', 'format']
>>> total_reward(functions, "19", "19")
2.0
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable

from zoo_gym.core.reward_functions import (
    BUILTIN,
    RewardFunction,
    closeness,
    exact_answer,
    format,
    length,
    total_reward,
)

__all__ = [
    "BUILTIN",
    "RewardError",
    "RewardFunction",
    "closeness",
    "exact_answer",
    "format",
    "length",
    "load_reward_functions",
    "resolve_import_path",
    "total_reward",
]


class RewardError(ValueError):
    """A reward function named by a task or a client config cannot be used."""


def load_reward_functions(
    task_names: Iterable[str], local_paths: Iterable[str]
) -> dict[str, RewardFunction]:
    """The reward functions of a round: the task's built-ins, then the contributor's own.

    `task_names` come from the coordinator and resolve only to built-ins;
    `local_paths` (``"module:function"``) come from the contributor's config and are
    imported from its own installation. Keys are the names and paths, in order.
    Raises `RewardError` with one line saying what to fix.
    """
    functions: dict[str, RewardFunction] = {}
    for name in task_names:
        if name not in BUILTIN:
            raise RewardError(
                f"the task names reward function {name!r}, which is not a built-in "
                f"({', '.join(BUILTIN)}); a coordinator may only name built-ins, so this task "
                "is refused (add your own rewards by import path in your client config)"
            )
        functions[name] = BUILTIN[name]
    for path in local_paths:
        functions[path] = resolve_import_path(path)
    if not functions:
        raise RewardError(
            "no reward functions: the task names none and the client config adds none"
        )
    return functions


def resolve_import_path(path: str) -> RewardFunction:
    """Import ``"package.module:function"`` from this installation and check it is callable."""
    module_name, sep, attribute = path.partition(":")
    if not sep or not module_name or not attribute:
        raise RewardError(
            f"reward function {path!r} is not an import path; write it as 'package.module:function'"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise RewardError(
            f"reward function {path!r}: cannot import {module_name!r} ({exc}); "
            "install it in this environment or fix reward_functions in your client config"
        ) from None
    target: object = module
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise RewardError(
                f"reward function {path!r}: {module_name!r} has no attribute {attribute!r}; "
                "fix reward_functions in your client config"
            )
        target = getattr(target, part)
    if not callable(target):
        raise RewardError(
            f"reward function {path!r} is a {type(target).__name__}, not a function "
            "(completion: str, answer: str) -> float"
        )
    function: RewardFunction = target
    return function
