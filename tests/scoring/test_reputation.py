"""Reputation EMA, selection weights and the trust ramp, by hand."""

from __future__ import annotations

import pytest
import torch

from zoo_gym.scoring import (
    Contribution,
    influence_weights,
    round_outcomes,
    sample_contributors,
    selection_weights,
    split_rewards,
    trust,
    update_reputations,
)


def test_round_outcomes_scale_quality_by_the_round_best() -> None:
    split = split_rewards(
        [
            Contribution("a", 0.3),
            Contribution("b", 0.1),
            Contribution("c", -0.2),
            Contribution("d", 0.9, rejection="rejected by krum: not selected"),
        ]
    )

    assert round_outcomes(split.rewards) == pytest.approx(
        {"a": 1.0, "b": 1 / 3, "c": 0.0, "d": 0.0}
    )
    assert round_outcomes(split_rewards([Contribution("a", -1.0)]).rewards) == {"a": 0.0}


def test_exponential_moving_average_by_hand() -> None:
    # a: 0.5 * 0.8 + 0.5 * 1 = 0.9; b (new, initial 0.5): 0.5 * 0.5 + 0 = 0.25; c absent: kept
    new = update_reputations({"a": 0.8, "c": 0.4}, {"a": 1.0, "b": 0.0}, alpha=0.5, initial=0.5)

    assert new == pytest.approx({"a": 0.9, "c": 0.4, "b": 0.25})


def test_reputation_over_several_rounds() -> None:
    # alpha 0.2 from 0: 0.2, then 0.8 * 0.2 + 0.2 * 0.5 = 0.26, then 0.8 * 0.26 = 0.208
    r: dict[str, float] = {}
    for s in (1.0, 0.5, 0.0):
        r = update_reputations(r, {"a": s})

    assert r["a"] == pytest.approx(0.208)


def test_alpha_one_keeps_only_the_last_round() -> None:
    assert update_reputations({"a": 0.9}, {"a": 0.25}, alpha=1.0) == {"a": 0.25}


@pytest.mark.parametrize("alpha", [0.0, -0.1, 1.5, float("nan")])
def test_alpha_outside_the_unit_interval_is_refused(alpha: float) -> None:
    with pytest.raises(ValueError, match=r"alpha must be in \(0, 1\]"):
        update_reputations({}, {"a": 1.0}, alpha=alpha)


def test_values_outside_the_unit_interval_are_refused() -> None:
    with pytest.raises(ValueError, match="outcome of 'a' must be a number in"):
        update_reputations({}, {"a": 1.5})
    with pytest.raises(ValueError, match="reputation of 'a' must be a number in"):
        update_reputations({"a": -0.1}, {})
    with pytest.raises(ValueError, match="initial reputation must be"):
        update_reputations({}, {}, initial=2.0)


def test_selection_weights_floor_and_normalise() -> None:
    # max(r, 0.1) = 0.6, 0.2, 0.1 over 0.9
    weights = selection_weights({"a": 0.6, "b": 0.2, "c": 0.0}, floor=0.1)

    assert weights == pytest.approx({"a": 2 / 3, "b": 2 / 9, "c": 1 / 9})
    assert selection_weights({}) == {}
    with pytest.raises(ValueError, match=r"floor must be in \(0, 1\]"):
        selection_weights({"a": 0.5}, floor=0.0)


def test_sampling_is_distinct_and_reproducible() -> None:
    reputations = {f"c{i}": i / 10 for i in range(10)}

    first = sample_contributors(reputations, 4, generator=torch.Generator().manual_seed(3))
    again = sample_contributors(reputations, 4, generator=torch.Generator().manual_seed(3))

    assert first == again
    assert len(set(first)) == 4 and set(first) <= set(reputations)
    assert sample_contributors(reputations, 20) == list(reputations)
    assert sample_contributors(reputations, 0) == []
    with pytest.raises(ValueError, match="k must be an int >= 0"):
        sample_contributors(reputations, -1)


def test_sampling_favours_reputation() -> None:
    counts = {"good": 0, "new": 0}
    generator = torch.Generator().manual_seed(0)
    for _ in range(400):
        (name,) = sample_contributors({"good": 1.0, "new": 0.0}, 1, floor=0.25, generator=generator)
        counts[name] += 1

    # probabilities 0.8 and 0.2
    assert 280 < counts["good"] < 360


def test_trust_ramps_from_zero_to_one() -> None:
    assert [trust(r, trusted_at=0.3) for r in (0.0, 0.15, 0.3, 0.9)] == [0.0, 0.5, 1.0, 1.0]
    assert trust(0.0, trusted_at=0.0) == 1.0  # rho = 0 trusts everyone


def test_influence_weights_floor_fresh_updates_and_cap_their_claims() -> None:
    # examples claimed: a fresh key claims 1e9; reputations: established, half-way, fresh
    weights = influence_weights([100, 50, 1e9], [0.6, 0.15, 0.0], trusted_at=0.3, floor=0.1)

    # median claim 100 caps the untrusted ones: 100 * 1, min(50, 100) * 0.5, min(1e9, 100) * 0.1
    assert weights == pytest.approx([100.0, 25.0, 10.0])


def test_influence_weights_treat_a_new_network_alike() -> None:
    weights = influence_weights([10, 30, 20], [0.0, 0.0, 0.0], trusted_at=0.3, floor=0.1)
    assert weights == [10.0, 20.0, 20.0]  # nobody trusted: claims capped at the median, no floor
