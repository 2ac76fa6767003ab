"""Individual and leave-one-out quality on a tiny linear utility, computed by hand."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from zoo_gym.scoring import METHODS, individual, leave_one_out, score_contributions

W = torch.tensor([1.0, 2.0])
# U(x) = w.x + 0.5; U(0) = 0.5
UPDATES = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, -1.0]])  # w.x_i = 1, 2, -3


def linear(x: Tensor) -> float:
    return float(W @ x) + 0.5


def mean(rows: Tensor) -> Tensor:
    return rows.mean(dim=0)


class Counting:
    """A utility that counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, x: Tensor) -> float:
        self.calls += 1
        return linear(x)


def test_individual_is_own_gain_over_the_base() -> None:
    utility = Counting()

    q = individual(UPDATES, utility=utility)

    assert q.scores == (1.0, 2.0, -3.0)
    assert q.baseline == 0.5
    assert (q.utility_calls, q.aggregations) == (4, 0)  # n + 1
    assert utility.calls == 4


def test_individual_with_known_baseline_saves_one_evaluation() -> None:
    q = individual(UPDATES, utility=linear, baseline=0.5)

    assert q.scores == (1.0, 2.0, -3.0)
    assert q.utility_calls == 3


def test_individual_update_that_breaks_the_model_scores_minus_infinity() -> None:
    def utility(x: Tensor) -> float:
        return math.nan if float(x.sum()) < 0 else linear(x)

    q = individual(UPDATES, utility=utility)

    assert q.scores[:2] == (1.0, 2.0)
    assert q.scores[2] == -math.inf


def test_leave_one_out_through_mean_aggregation() -> None:
    # U(mean(all)) = 0.5; without 1: mean = (-0.5, 0) -> 0; without 2: (0, -0.5) -> -0.5;
    # without 3: (0.5, 0.5) -> 2.0. So q = 0.5 - 0, 0.5 + 0.5, 0.5 - 2.0.
    utility = Counting()

    q = leave_one_out(UPDATES, utility=utility, aggregate_fn=mean)

    assert q.scores == (0.5, 1.0, -1.5)
    assert q.aggregate_utility == 0.5
    assert (q.utility_calls, q.aggregations) == (4, 4)  # n + 1 each
    assert utility.calls == 4


def test_leave_one_out_of_a_single_update_compares_with_the_base() -> None:
    q = leave_one_out(UPDATES[1:2], utility=linear, aggregate_fn=mean)

    assert q.scores == (2.0,)
    assert q.baseline == 0.5
    assert (q.utility_calls, q.aggregations) == (2, 1)


def test_leave_one_out_reports_a_rule_that_needs_more_updates() -> None:
    def needs_three(rows: Tensor) -> Tensor:
        if rows.shape[0] < 3:
            raise ValueError(
                f"krum with f=0 needs n >= 2f + 3 (at least 3 updates), got {rows.shape[0]}"
            )
        return rows.mean(dim=0)

    with pytest.raises(
        ValueError, match=r"leave_one_out: .* coalition of 2 of the 3 updates .*individual"
    ):
        leave_one_out(UPDATES, utility=linear, aggregate_fn=needs_three)


def test_leave_one_out_needs_an_aggregate_fn() -> None:
    with pytest.raises(ValueError, match="leave_one_out needs aggregate_fn"):
        leave_one_out(UPDATES, utility=linear)


def test_aggregate_fn_of_the_wrong_shape_is_refused() -> None:
    with pytest.raises(ValueError, match=r"must return a \(2,\) tensor, got \(3,\)"):
        leave_one_out(UPDATES, utility=linear, aggregate_fn=lambda rows: torch.zeros(3))


def test_updates_must_be_one_matrix() -> None:
    with pytest.raises(
        ValueError,
        match=r"individual: updates must be one \(n, d\) tensor or column source, got \(2,\)",
    ):
        individual(torch.zeros(2), utility=linear)
    with pytest.raises(ValueError, match="floating point"):
        individual(torch.zeros(2, 2, dtype=torch.long), utility=linear)


def test_a_base_without_a_finite_utility_is_refused() -> None:
    with pytest.raises(ValueError, match="utility of the base itself is nan"):
        individual(UPDATES, utility=lambda x: math.nan)


def test_score_contributions_dispatches_by_name() -> None:
    assert set(METHODS) == {
        "individual",
        "leave_one_out",
        "gtg_shapley",
        "exact_shapley",
        "first_order",
    }
    assert score_contributions(UPDATES, utility=linear).scores == (1.0, 2.0, -3.0)
    loo = score_contributions(UPDATES, utility=linear, method="leave_one_out", aggregate_fn=mean)
    assert loo.scores == (0.5, 1.0, -1.5)
    with pytest.raises(ValueError, match="unknown quality method 'banzhaf'"):
        score_contributions(UPDATES, utility=linear, method="banzhaf")


def test_quality_through_the_rounds_own_aggregation_rule() -> None:
    from zoo_gym.aggregation import aggregate

    # fedavg of a subset is its mean: the same numbers as the hand-computed mean case
    fedavg = score_contributions(
        UPDATES,
        utility=linear,
        method="leave_one_out",
        aggregate_fn=lambda rows: aggregate("fedavg", rows).vector,
    )
    assert fedavg.scores == pytest.approx((0.5, 1.0, -1.5))

    # Krum with f=1 needs 5 updates; leaving one of 5 out leaves 4
    five = torch.cat([UPDATES, UPDATES[:2]])
    with pytest.raises(ValueError, match=r"coalition of 4 of the 5 updates \(krum with f=1 needs"):
        leave_one_out(
            five, utility=linear, aggregate_fn=lambda rows: aggregate("krum", rows, f=1).vector
        )
