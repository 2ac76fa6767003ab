"""GTG-Shapley against exact Shapley values: additive games, enumeration, truncation, seeds."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor

from zoo_gym.scoring import exact_shapley, gtg_shapley

W = torch.tensor([1.0, 2.0])
# with sum aggregation and U(x) = w.x + 0.5 the game is additive: v(C) = 0.5 + sum of w.x_i
UPDATES = torch.tensor(
    [[1.0, 0.0], [0.0, 1.0], [-0.5, 0.0], [0.25, 0.0]]
)  # w.x_i = 1, 2, -0.5, 0.25
TARGET = torch.tensor([1.0, -1.0, 0.5], dtype=torch.float64)
# a non-additive game: mean aggregation, U(x) = -||x - target||^2
NOISY = torch.randn(4, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


def linear(x: Tensor) -> float:
    return float(W @ x) + 0.5


def total(rows: Tensor) -> Tensor:
    return rows.sum(dim=0)


def mean(rows: Tensor) -> Tensor:
    return rows.mean(dim=0)


def neg_sq_loss(x: Tensor) -> float:
    return -float((x.double() - TARGET).square().sum())


def test_exact_shapley_by_hand_for_two_updates() -> None:
    # mean aggregation, U = w.x: v({}) = 0, v({1}) = 2, v({2}) = 0, v({1, 2}) = 1
    # phi_1 = (2 - 0) / 2 + (1 - 0) / 2 = 1.5; phi_2 = (0 - 0) / 2 + (1 - 2) / 2 = -0.5
    x = torch.tensor([[2.0, 0.0], [0.0, 0.0]])

    q = exact_shapley(x, utility=lambda v: float(W @ v), aggregate_fn=mean)

    assert q.scores == (1.5, -0.5)
    assert (q.utility_calls, q.aggregations) == (4, 3)  # 2^n and 2^n - 1


def test_gtg_is_exact_on_an_additive_game() -> None:
    # every marginal of i is w.x_i, whatever the order: each permutation is exact
    q = gtg_shapley(
        UPDATES,
        utility=linear,
        aggregate_fn=total,
        between_round_tol=0.0,
        within_round_tol=0.0,
        exact_when_complete=False,
    )

    assert q.scores == pytest.approx((1.0, 2.0, -0.5, 0.25), abs=1e-12)
    assert q.converged
    assert q.permutations == 32  # min_permutations=30, checked at the end of blocks of n=4
    assert q.utility_calls <= 2**4


def test_gtg_with_default_truncation_on_an_additive_game() -> None:
    q = gtg_shapley(UPDATES, utility=linear, aggregate_fn=total, exact_when_complete=False)

    assert q.scores == pytest.approx((1.0, 2.0, -0.5, 0.25), abs=1e-12)


def test_gtg_estimates_exact_shapley_values_of_a_non_additive_game() -> None:
    exact = exact_shapley(NOISY, utility=neg_sq_loss, aggregate_fn=mean)

    q = gtg_shapley(
        NOISY,
        utility=neg_sq_loss,
        aggregate_fn=mean,
        between_round_tol=0.0,
        within_round_tol=0.0,
        tolerance=1e-6,
        max_permutations=2000,
        exact_when_complete=False,
    )

    assert q.permutations == 2000
    assert not q.converged
    assert "max_permutations=2000" in q.note
    assert q.scores == pytest.approx(exact.scores, abs=0.1)
    # untruncated permutations telescope: the estimate is efficient to rounding
    assert exact.aggregate_utility is not None and exact.baseline is not None
    assert sum(q.scores) == pytest.approx(exact.aggregate_utility - exact.baseline, abs=1e-9)
    order = sorted(range(4), key=lambda i: q.scores[i])
    assert order == sorted(range(4), key=lambda i: exact.scores[i])


def test_gtg_returns_exact_values_once_every_coalition_is_cached() -> None:
    exact = exact_shapley(NOISY, utility=neg_sq_loss, aggregate_fn=mean)

    q = gtg_shapley(NOISY, utility=neg_sq_loss, aggregate_fn=mean)

    assert q.scores == pytest.approx(exact.scores, abs=1e-12)
    assert q.converged and "exact values" in q.note
    assert q.utility_calls == 2**4


def test_gtg_is_deterministic_under_a_seed() -> None:
    def run(seed: int) -> tuple[float, ...]:
        return gtg_shapley(
            NOISY,
            utility=neg_sq_loss,
            aggregate_fn=mean,
            seed=seed,
            max_permutations=40,
            exact_when_complete=False,
        ).scores

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_between_round_truncation_scores_everyone_zero() -> None:
    # w.x sums to 0: the aggregate does not change the utility
    x = torch.tensor([[1.0, 0.0], [-1.0, 0.0]])

    q = gtg_shapley(x, utility=linear, aggregate_fn=total)

    assert q.scores == (0.0, 0.0)
    assert q.permutations == 0
    assert q.note.startswith("between-round truncation")
    assert q.utility_calls == 2


def test_within_round_truncation_skips_evaluations_once_the_prefix_reaches_the_total() -> None:
    # additive values 1, 2, 0, ..., 0: once 1 and 2 have joined, the rest get marginal 0 unseen
    x = torch.zeros(8, 2)
    x[0, 0], x[1, 1] = 1.0, 1.0

    def run(within_round_tol: float) -> tuple[tuple[float, ...], int]:
        q = gtg_shapley(
            x,
            utility=linear,
            aggregate_fn=total,
            within_round_tol=within_round_tol,
            min_permutations=8,
            max_permutations=8,
        )
        return q.scores, q.utility_calls

    truncated, calls = run(1e-3)
    untruncated, all_calls = run(0.0)

    assert truncated == pytest.approx((1.0, 2.0, 0, 0, 0, 0, 0, 0), abs=1e-12)
    assert untruncated == pytest.approx(truncated, abs=1e-12)
    assert calls < all_calls


def test_shapley_reports_coalitions_the_rule_cannot_aggregate() -> None:
    def needs_two(rows: Tensor) -> Tensor:
        if rows.shape[0] < 2:
            raise ValueError("needs at least 2 updates")
        return rows.mean(dim=0)

    with pytest.raises(ValueError, match=r"gtg_shapley: .* coalition of 1 of the 4 updates"):
        gtg_shapley(UPDATES, utility=linear, aggregate_fn=needs_two)
    with pytest.raises(ValueError, match="exact_shapley needs aggregate_fn"):
        exact_shapley(UPDATES, utility=linear)


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("between_round_tol", -1.0),
        ("within_round_tol", float("nan")),
        ("tolerance", 0.0),
        ("window", 0),
        ("max_permutations", 0),
    ],
)
def test_gtg_options_are_checked(option: str, value: Any) -> None:
    options: dict[str, Any] = {option: value}
    with pytest.raises(ValueError, match=f"gtg_shapley: {option} must be"):
        gtg_shapley(UPDATES, utility=linear, aggregate_fn=total, **options)


def test_exact_shapley_refuses_too_many_updates() -> None:
    with pytest.raises(ValueError, match="use method='gtg_shapley'"):
        exact_shapley(torch.zeros(13, 1), utility=linear, aggregate_fn=total)
