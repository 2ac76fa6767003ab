"""Cost bounds of scoring: the time budget's fallback and the seeded validation subset."""

from __future__ import annotations

import time

import pytest
import torch
from torch import Tensor

from zoo_gym.scoring import score_contributions, validation_subset

W = torch.tensor([1.0, 2.0])
UPDATES = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, -1.0], [2.0, -0.5]])
FIRST_ORDER = (1.0, 2.0, -3.0, 1.0)  # w . x_i


def quadratic(x: Tensor) -> float:
    return float(W @ x - 0.5 * x @ x)


def mean(rows: Tensor) -> Tensor:
    return rows.mean(dim=0)


@pytest.mark.parametrize("method", ["individual", "leave_one_out", "gtg_shapley"])
def test_spent_budget_scores_the_whole_round_by_first_order(method: str) -> None:
    calls = []

    def utility(x: Tensor) -> float:
        calls.append(1)
        return quadratic(x)

    q = score_contributions(
        UPDATES,
        utility=utility,
        method=method,
        aggregate_fn=mean,
        gradient=lambda: W,
        seconds=0.0,
    )

    assert calls == []  # no evaluation starts once the budget is spent
    assert q.method == "first_order" and q.fallback_from == method
    assert q.scores == FIRST_ORDER
    assert (q.utility_calls, q.backward_passes) == (0, 1)
    assert q.note == (
        f"{method} ran out of the 0 s scoring budget after 0 evaluations; "
        "every contribution scored by first_order"
    )


def test_budget_running_out_midway_gives_the_same_scores_and_counts_what_ran() -> None:
    # each evaluation takes 30 ms; the budget allows a few of the n + 1 = 5, never all
    def slow(x: Tensor) -> float:
        time.sleep(0.03)
        return quadratic(x)

    q = score_contributions(
        UPDATES, utility=slow, method="individual", gradient=lambda: W, seconds=0.05
    )

    assert q.fallback_from == "individual"
    assert q.scores == FIRST_ORDER  # wherever it ran out
    assert 1 <= q.utility_calls < 5
    assert q.seconds >= 0.05
    assert f"after {q.utility_calls} evaluations" in q.note


def test_budget_large_enough_changes_nothing() -> None:
    unbounded = score_contributions(UPDATES, utility=quadratic, method="individual")
    bounded = score_contributions(
        UPDATES, utility=quadratic, method="individual", gradient=lambda: W, seconds=60.0
    )

    assert bounded.scores == unbounded.scores == (0.5, 1.5, -4.0, -1.125)
    assert bounded.fallback_from == "" and bounded.method == "individual"
    assert (bounded.utility_calls, bounded.backward_passes) == (5, 0)


def test_leave_one_out_fallback_counts_its_aggregations() -> None:
    def slow(x: Tensor) -> float:
        time.sleep(0.03)
        return quadratic(x)

    q = score_contributions(
        UPDATES,
        utility=slow,
        method="leave_one_out",
        aggregate_fn=mean,
        gradient=lambda: W,
        seconds=0.05,
    )

    assert q.fallback_from == "leave_one_out"
    assert q.aggregations >= q.utility_calls - 1 >= 0  # every coalition aggregates first


def test_budget_needs_a_gradient_for_its_fallback() -> None:
    with pytest.raises(ValueError, match="a time budget \\(seconds\\) needs gradient"):
        score_contributions(UPDATES, utility=quadratic, seconds=1.0)
    with pytest.raises(ValueError, match="seconds must be a finite number >= 0"):
        score_contributions(UPDATES, utility=quadratic, gradient=lambda: W, seconds=-1.0)


def test_validation_subset_is_fixed_by_its_seed() -> None:
    first = validation_subset(1000, 256, seed=7)
    again = validation_subset(1000, 256, seed=7)
    other = validation_subset(1000, 256, seed=8)

    assert first == again
    assert first != other
    assert len(first) == len(set(first)) == 256
    assert list(first) == sorted(first) and first[0] >= 0 and first[-1] < 1000
    # pinned: the same indices on every machine (torch.randperm from a seeded CPU generator)
    expected = sorted(torch.randperm(1000, generator=torch.Generator().manual_seed(7))[:256])
    assert list(first) == [int(i) for i in expected]


def test_validation_subset_takes_every_record_when_the_set_is_small() -> None:
    assert validation_subset(200, 256, seed=3) == tuple(range(200))
    assert validation_subset(5, 5, seed=3) == (0, 1, 2, 3, 4)
    with pytest.raises(ValueError, match="need at least one record and one example"):
        validation_subset(0, 256, seed=3)
