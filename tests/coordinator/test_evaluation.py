"""The coordinator's reward of a model: greedy completions of the validation prompts, scored by
the built-in reward functions."""

from __future__ import annotations

from pathlib import Path

import pytest

from zoo_gym.coordinator.evaluation import Evaluator
from zoo_gym.core.weights import load_weights


@pytest.fixture(scope="module")
def evaluator(tiny_home_template: Path) -> Evaluator:
    return Evaluator(
        tiny_home_template / "models" / "v0000", tiny_home_template / "validation.jsonl"
    )


def test_batches_score_as_prompts_one_by_one(
    evaluator: Evaluator, tiny_home_template: Path
) -> None:
    # left padding must not change a greedy completion: batch 64 equals batch 1
    state = load_weights(tiny_home_template / "models" / "v0000")
    names = ["closeness", "exact_answer", "format"]

    texts = evaluator.completions(state, max_new_tokens=8)
    texts_one_by_one = evaluator.completions(state, max_new_tokens=8, batch_size=1)
    batched = evaluator.mean_rewards(state, reward_functions=names, max_new_tokens=8)
    single = evaluator.mean_rewards(state, reward_functions=names, max_new_tokens=8, batch_size=1)

    # the texts themselves (the untrained base scores 0 on every reward, so scores alone could
    # not tell a broken padding from a working one)
    assert len(texts) == len(evaluator.prompts) > 1 and len(set(texts)) > 1
    assert texts == texts_one_by_one
    assert batched == pytest.approx(single, abs=1e-12)
    assert set(batched) == set(names) and all(0.0 <= v <= 1.0 for v in batched.values())
    total = evaluator.mean_reward(state, reward_functions=names, max_new_tokens=8)
    assert total == pytest.approx(sum(batched.values()))


def test_only_builtin_reward_functions(evaluator: Evaluator) -> None:
    with pytest.raises(ValueError, match="reward_functions must name built-ins"):
        evaluator.mean_rewards({}, reward_functions=["mymodule:reward"], max_new_tokens=8)
