"""The reward split on hand-computed rounds: proportions, reasons, exact rounding, errors."""

from __future__ import annotations

from decimal import Decimal

import pytest

from zoo_gym.scoring import Contribution, RewardPolicy, split_rewards

KRUM = "rejected by krum: not the lowest Krum score (score 65)"


def amounts(*contributions: Contribution, **policy: object) -> list[Decimal]:
    split = split_rewards(contributions, policy=RewardPolicy(**policy))  # type: ignore[arg-type]
    return [r.amount for r in split.rewards]


def test_pool_split_in_proportion_to_positive_quality() -> None:
    round_ = [
        Contribution("a", 0.3),
        Contribution("b", 0.1),
        Contribution("c", -0.2),
        Contribution("d", 0.5, rejection=KRUM),
    ]

    split = split_rewards(round_, policy=RewardPolicy(pool=Decimal(100)))

    assert [r.amount for r in split.rewards] == [Decimal(75), Decimal(25), 0, 0]
    assert [r.qualified for r in split.rewards] == [True, True, False, False]
    assert [r.share for r in split.rewards] == [0.75, 0.25, 0.0, 0.0]
    assert split.rewards[0].reason == "paid 75.00% of the pool for quality 0.3"
    assert split.rewards[2].reason == "quality -0.2 below the minimum 0.0"
    assert split.rewards[3].reason == KRUM
    assert split.paid == Decimal(100)
    assert split.summary == "paid 100 to 2 of 4 contributions in proportion to quality"


def test_amounts_are_whole_units_of_the_policy() -> None:
    split = split_rewards([Contribution("a", 0.3)], policy=RewardPolicy(pool=Decimal(100)))

    assert split.rewards[0].amount.as_tuple().exponent == -6  # micro-units
    assert str(split.rewards[0].amount) == "100.000000"


def test_largest_remainder_makes_the_amounts_sum_exactly_to_the_pool() -> None:
    # 100 / 3 = 33.33... each: one cent left over goes to the earliest of the equal remainders
    equal = amounts(
        Contribution("a", 0.2), Contribution("b", 0.2), Contribution("c", 0.2), unit=Decimal("0.01")
    )
    assert equal == [Decimal("33.34"), Decimal("33.33"), Decimal("33.33")]
    assert sum(equal) == Decimal(100)

    # quotas 10 * (4, 3, 2) / 9 = 4.44, 3.33, 2.22: floors 4, 3, 2 and the one unit left goes
    # to the largest remainder (.44)
    assert amounts(
        Contribution("a", 4.0), Contribution("b", 3.0), Contribution("c", 2.0), pool=10, unit=1
    ) == [5, 3, 2]
    # quotas 9 * (4, 3, 2) / 9 = 4, 3, 2 exactly
    assert amounts(
        Contribution("a", 4.0), Contribution("b", 3.0), Contribution("c", 2.0), pool=9, unit=1
    ) == [4, 3, 2]
    # quotas 7 * (0.7, 0.2, 0.1) = 4.9, 1.4, 0.7: floors 4, 1, 0; two units left go to .9 and .7
    assert amounts(
        Contribution("a", 0.7), Contribution("b", 0.2), Contribution("c", 0.1), pool=7, unit=1
    ) == [5, 1, 1]


def test_many_awkward_qualities_still_sum_to_the_pool() -> None:
    round_ = [Contribution(f"c{i}", 1.0 / (i + 3)) for i in range(17)]

    split = split_rewards(round_, policy=RewardPolicy(pool=Decimal("1234.567891")))

    assert split.paid == Decimal("1234.567891")
    assert sum(r.amount for r in split.rewards) == Decimal("1234.567891")
    assert all(r.amount > 0 for r in split.rewards)


def test_all_harmful_round_pays_nothing_and_says_so() -> None:
    split = split_rewards(
        [Contribution("a", -0.0123), Contribution("b", 0.0), Contribution("c", rejection=KRUM)]
    )

    assert [r.amount for r in split.rewards] == [0, 0, 0]
    assert split.paid == 0
    assert split.rewards[0].reason == "quality -0.0123 below the minimum 0.0"
    assert split.rewards[1].reason == "quality 0 not above the minimum 0.0"
    assert split.summary == (
        "nothing paid: no contribution had quality above the minimum 0.0; "
        "the pool of 100 is not paid out"
    )


def test_min_quality_excludes_small_improvements() -> None:
    split = split_rewards(
        [Contribution("a", 0.3), Contribution("b", 0.05)],
        policy=RewardPolicy(pool=Decimal(40), min_quality=0.1),
    )

    assert [r.amount for r in split.rewards] == [40, 0]
    assert split.rewards[1].reason == "quality 0.05 below the minimum 0.1"


def test_unscored_and_unmeasurable_contributions_earn_zero() -> None:
    split = split_rewards(
        [Contribution("a", None), Contribution("b", float("nan")), Contribution("c", 1.0)]
    )

    assert [r.amount for r in split.rewards] == [0, 0, 100]
    assert split.rewards[0].reason == "accepted but not scored: no quality to pay for"
    assert split.rewards[1].reason == "quality could not be measured (not a number)"


def test_reputation_weighting() -> None:
    # weights 0.2 * (0.5 + 0.5 * 1) = 0.2 and 0.2 * (0.5 + 0.5 * 0) = 0.1 -> 60 and 30 of 90
    policy = RewardPolicy(pool=Decimal(90), reputation_weight=0.5)

    split = split_rewards(
        [Contribution("a", 0.2), Contribution("b", 0.2)],
        policy=policy,
        reputations={"a": 1.0, "b": 0.0},
    )

    assert [r.amount for r in split.rewards] == [60, 30]
    assert split.rewards[1].reason == "paid 33.33% of the pool for quality 0.2 at reputation 0.000"
    with pytest.raises(ValueError, match="no reputation for 'b'"):
        split_rewards(
            [Contribution("a", 0.2), Contribution("b", 0.2)], policy=policy, reputations={"a": 1.0}
        )


def test_empty_pool_and_empty_round() -> None:
    split = split_rewards([Contribution("a", 0.3)], policy=RewardPolicy(pool=Decimal(0)))
    assert split.rewards[0].amount == 0 and split.rewards[0].qualified
    assert split.summary == "nothing paid: 1 of 1 contributions qualified, but the pool is empty"

    assert split_rewards([]).summary == "nothing paid: no contributions this round"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"pool": Decimal(-1)}, "pool must be >= 0"),
        ({"pool": Decimal("1.5"), "unit": Decimal(1)}, "not a whole number of units"),
        ({"unit": Decimal(0)}, "unit must be > 0"),
        ({"pool": Decimal("NaN")}, "pool must be finite"),
        ({"min_quality": -0.1}, "min_quality must be a finite number >= 0"),
        ({"reputation_weight": 1.0}, r"reputation_weight must be in \[0, 1\)"),
    ],
)
def test_bad_policies_are_refused(options: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RewardPolicy(**options)  # type: ignore[arg-type]


def test_policy_accepts_plain_numbers_as_decimals() -> None:
    assert RewardPolicy(pool=250, unit="0.01").pool == Decimal(250)  # type: ignore[arg-type]


def test_a_contributor_appears_once_per_round() -> None:
    with pytest.raises(ValueError, match="contributor 'a' appears twice"):
        split_rewards([Contribution("a", 0.1), Contribution("a", 0.2)])


def test_a_fresh_identity_earns_nothing_beside_trusted_contributors() -> None:
    # the round a fresh Sybil's noise scored better than the honest updates (seen under FedAvg)
    round_ = [Contribution("sybil", 0.4666), Contribution("a", 0.0004), Contribution("b", 0.0002)]
    reputations = {"a": 0.6, "b": 0.15}  # "b" is half way up the ramp (rho = 0.3)

    split = split_rewards(
        round_,
        policy=RewardPolicy(pool=Decimal(100), trusted_reputation=0.3),
        reputations=reputations,
    )

    # weights q * min(1, r / rho): 0, 0.0004 * 1, 0.0002 * 0.5 -> 80 / 20
    assert [r.amount for r in split.rewards] == [0, Decimal(80), Decimal(20)]
    assert split.rewards[0].qualified and "a new identity earns" in split.rewards[0].reason
    assert (
        split.rewards[1].reason == "paid 80.00% of the pool for quality 0.0004 at reputation 0.600"
    )


def test_when_nobody_is_trusted_yet_quality_alone_decides() -> None:
    round_ = [Contribution("a", 0.3), Contribution("b", 0.1)]

    split = split_rewards(
        round_, policy=RewardPolicy(pool=Decimal(100), trusted_reputation=0.3), reputations={}
    )

    assert [r.amount for r in split.rewards] == [Decimal(75), Decimal(25)]


def test_trusted_reputation_outside_the_unit_interval_is_refused() -> None:
    with pytest.raises(ValueError, match="trusted_reputation"):
        RewardPolicy(trusted_reputation=1.5)
