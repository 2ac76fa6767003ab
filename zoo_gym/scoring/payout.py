"""The reward policy: split a round's pool in proportion to positive quality.

A contribution qualifies when it was accepted and its quality q_i is above the minimum
(q_i > min_quality >= 0). Each qualifying contribution gets the weight

    w_i = q_i * ((1 - lambda) + lambda * r_i)

with r_i in [0, 1] its contributor's reputation and lambda = `reputation_weight` in [0, 1)
(lambda = 0, the default, pays by quality alone). With rho = `trusted_reputation` > 0 the
weight is further multiplied by the contributor's trust t_i = min(1, r_i / rho) (see
`zoo_gym.scoring.reputation`): a fresh identity (r = 0) earns nothing while a trusted one
qualifies in the same round, and earns in full once r_i >= rho. When no qualifying
contributor has t > 0 (a new network), t = 1 for all of them. Each is paid

    amount_i = pool * w_i / sum_j w_j,

rounded to whole `unit`s by the largest-remainder method [Hamilton, 1792] so that the
amounts sum exactly to the pool. Everything else (rejected, invalid, unscored, harmful or
below the minimum) earns zero, with a one-line reason. If nobody qualifies nothing is paid.

Amounts are `decimal.Decimal`, computed from exact rational weights (`fractions.Fraction`
of the float qualities) in integer units: no binary rounding reaches the ledger.
"""

from __future__ import annotations

import decimal
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction

__all__ = ["Contribution", "Payout", "RewardPolicy", "RewardSplit", "split_rewards"]


@dataclass(frozen=True)
class Contribution:
    """One contribution of a round as the reward split sees it.

    `quality`: its score (see `score_contributions`), None when it was not scored.
    `rejection`: None when it was accepted; otherwise the one-line reason intake or the
    aggregation rule rejected it (for example "rejected by krum: not the lowest Krum score
    (score 65)"), which becomes the reason it earns zero.
    """

    contributor: str
    quality: float | None = None
    rejection: str | None = None


@dataclass(frozen=True)
class RewardPolicy:
    """How a round's pool is split.

    `pool`: amount paid per round, >= 0, a whole number of `unit`s. `min_quality`: a
    contribution must score above it (>= 0; 0 pays every helpful one). `reputation_weight`:
    lambda in [0, 1), how much reputation scales the weight of quality (0: not at all; 0.5:
    reputation 0 halves the weight that reputation 1 gets). `unit`: the smallest amount
    paid (default one micro-unit). `trusted_reputation`: rho in [0, 1], the reputation from
    which a contributor earns in full (0: everyone does; see the module docstring).
    """

    pool: Decimal = Decimal(100)
    min_quality: float = 0.0
    reputation_weight: float = 0.0
    unit: Decimal = Decimal("0.000001")
    trusted_reputation: float = 0.0

    def __post_init__(self) -> None:
        pool, unit = _decimal(self.pool, "pool"), _decimal(self.unit, "unit")
        object.__setattr__(self, "pool", pool)
        object.__setattr__(self, "unit", unit)
        if unit <= 0:
            raise ValueError(f"reward policy: unit must be > 0, got {unit}")
        if pool < 0:
            raise ValueError(f"reward policy: pool must be >= 0, got {pool}")
        with decimal.localcontext() as ctx:
            ctx.prec = 60
            if pool % unit != 0:
                raise ValueError(
                    f"reward policy: pool {pool} is not a whole number of units of {unit}; "
                    "round the pool or use a smaller unit"
                )
        if not math.isfinite(self.min_quality) or self.min_quality < 0:
            raise ValueError(
                f"reward policy: min_quality must be a finite number >= 0, got {self.min_quality}"
            )
        if not 0.0 <= self.trusted_reputation <= 1.0:
            raise ValueError(
                f"reward policy: trusted_reputation must be in [0, 1], got {self.trusted_reputation}"
            )
        if not 0.0 <= self.reputation_weight < 1.0:
            raise ValueError(
                f"reward policy: reputation_weight must be in [0, 1), got {self.reputation_weight}"
            )

    @property
    def pool_units(self) -> int:
        """The pool as a whole number of units."""
        with decimal.localcontext() as ctx:
            ctx.prec = 60
            return int(self.pool / self.unit)


@dataclass(frozen=True)
class Payout:
    """What one contribution earned: `amount` (a whole number of units), its `share` of the
    pool, whether it `qualified`, and a one-line `reason`."""

    contributor: str
    quality: float | None
    amount: Decimal
    share: float
    qualified: bool
    reason: str


@dataclass(frozen=True)
class RewardSplit:
    """The rewards of one round, in the order of the contributions, and a one-line summary.

    `paid` is the sum of the amounts: the whole pool, or 0 when nobody qualified.
    """

    rewards: tuple[Payout, ...]
    pool: Decimal
    paid: Decimal
    summary: str


def split_rewards(
    contributions: Sequence[Contribution],
    *,
    policy: RewardPolicy | None = None,
    reputations: Mapping[str, float] | None = None,
) -> RewardSplit:
    """Split `policy.pool` over the contributions in proportion to positive quality.

    See the module docstring for the rule. `reputations` (contributor -> r in [0, 1]) is
    needed for every qualifying contributor when `policy.reputation_weight` > 0. Each
    contributor may appear once. The amounts sum exactly to the pool, or are all zero when
    no contribution qualifies (or the pool is 0).
    """
    policy = RewardPolicy() if policy is None else policy
    _check_unique(contributions)
    qualified = [_qualifies(c, policy) for c in contributions]
    trusts = _trusts(contributions, qualified, policy, reputations)
    weights = {
        i: _weight(c, policy, reputations) * Fraction(trusts[i])
        for i, c in enumerate(contributions)
        if qualified[i]
    }
    units = _apportion(policy.pool_units, {i: w for i, w in weights.items() if w > 0})
    rewards = tuple(
        _reward(c, policy, units.get(i, 0), qualified[i], reputations, trusts.get(i, 1.0))
        for i, c in enumerate(contributions)
    )
    with decimal.localcontext() as ctx:
        ctx.prec = 60
        paid = sum((r.amount for r in rewards), Decimal(0))
    return RewardSplit(
        rewards=rewards,
        pool=policy.pool,
        paid=paid,
        summary=_summary(len(contributions), len(weights), policy),
    )


def _trusts(
    contributions: Sequence[Contribution],
    qualified: Sequence[bool],
    policy: RewardPolicy,
    reputations: Mapping[str, float] | None,
) -> dict[int, float]:
    """t_i = min(1, r_i / rho) of each qualifying contribution (a contributor without a
    reputation is new: r = 0); all 1 when rho = 0 or when none of them has t > 0."""
    rho = policy.trusted_reputation
    known = reputations or {}
    trusts = {
        i: min(1.0, float(known.get(c.contributor, 0.0)) / rho) if rho > 0 else 1.0
        for i, c in enumerate(contributions)
        if qualified[i]
    }
    if not any(trusts.values()):
        return dict.fromkeys(trusts, 1.0)
    return trusts


def _apportion(total: int, weights: Mapping[int, Fraction]) -> dict[int, int]:
    """Largest remainder: split `total` units in proportion to `weights` (> 0), exactly.

    Each key gets floor(total * w / sum w); the units left over go one each to the largest
    remainders, ties to the larger weight, then to the earlier key.
    """
    if not weights:
        return {}
    whole = sum(weights.values(), Fraction(0))
    quotas = {i: total * w / whole for i, w in weights.items()}
    units = {i: q.numerator // q.denominator for i, q in quotas.items()}
    left = total - sum(units.values())
    order = sorted(weights, key=lambda i: (-(quotas[i] - units[i]), -weights[i], i))
    for i in order[:left]:
        units[i] += 1
    return units


def _qualifies(c: Contribution, policy: RewardPolicy) -> bool:
    q = c.quality
    return c.rejection is None and q is not None and math.isfinite(q) and q > policy.min_quality


def _weight(
    c: Contribution, policy: RewardPolicy, reputations: Mapping[str, float] | None
) -> Fraction:
    """w_i = q_i * ((1 - lambda) + lambda * r_i), as an exact fraction."""
    assert c.quality is not None
    quality = Fraction(c.quality)
    if policy.reputation_weight == 0.0:
        return quality
    lam = Fraction(policy.reputation_weight)
    return quality * ((1 - lam) + lam * Fraction(_reputation(c.contributor, reputations)))


def _reputation(contributor: str, reputations: Mapping[str, float] | None) -> float:
    if reputations is None or contributor not in reputations:
        raise ValueError(
            f"reward split: no reputation for {contributor!r}; reputation_weight > 0 needs one "
            "for every qualifying contributor (use the initial reputation for newcomers)"
        )
    r = float(reputations[contributor])
    if not 0.0 <= r <= 1.0:
        raise ValueError(f"reward split: reputation of {contributor!r} must be in [0, 1], got {r}")
    return r


def _reward(
    c: Contribution,
    policy: RewardPolicy,
    units: int,
    qualified: bool,
    reputations: Mapping[str, float] | None,
    trust: float = 1.0,
) -> Payout:
    with decimal.localcontext() as ctx:
        ctx.prec = 60
        ctx.traps[decimal.Inexact] = True  # amounts are exact or the split fails loudly
        amount = policy.unit * units
    share = float(Fraction(amount) / Fraction(policy.pool)) if policy.pool > 0 else 0.0
    reason = (
        _reason(c, policy)
        if not qualified
        else _paid_reason(c, policy, share, reputations)
        if trust > 0
        else f"quality {c.quality:.4g}, but a new identity earns in proportion to its reputation "
        f"(0, trusted from {policy.trusted_reputation:g}): nothing yet"
    )
    return Payout(c.contributor, c.quality, amount, share, qualified, reason)


def _reason(c: Contribution, policy: RewardPolicy) -> str:
    """Why a contribution that did not qualify earns zero, in one line."""
    if c.rejection is not None:
        return c.rejection.strip() or "rejected"
    q = c.quality
    if q is None:
        return "accepted but not scored: no quality to pay for"
    if math.isnan(q):
        return "quality could not be measured (not a number)"
    if q < policy.min_quality:
        return f"quality {q:.4g} below the minimum {policy.min_quality}"
    return f"quality {q:.4g} not above the minimum {policy.min_quality}"


def _paid_reason(
    c: Contribution, policy: RewardPolicy, share: float, reputations: Mapping[str, float] | None
) -> str:
    assert c.quality is not None
    if policy.pool == 0:
        return f"qualified with quality {c.quality:.4g}, but the pool is empty"
    reason = f"paid {share:.2%} of the pool for quality {c.quality:.4g}"
    if policy.reputation_weight > 0.0:
        reason += f" at reputation {_reputation(c.contributor, reputations):.3f}"
    elif policy.trusted_reputation > 0.0 and reputations and c.contributor in reputations:
        reason += f" at reputation {float(reputations[c.contributor]):.3f}"
    return reason


def _summary(n: int, qualifying: int, policy: RewardPolicy) -> str:
    if n == 0:
        return "nothing paid: no contributions this round"
    if qualifying == 0:
        return (
            f"nothing paid: no contribution had quality above the minimum {policy.min_quality}; "
            f"the pool of {policy.pool} is not paid out"
        )
    if policy.pool == 0:
        return f"nothing paid: {qualifying} of {n} contributions qualified, but the pool is empty"
    by = "quality weighted by reputation" if policy.reputation_weight > 0.0 else "quality"
    return f"paid {policy.pool} to {qualifying} of {n} contributions in proportion to {by}"


def _check_unique(contributions: Sequence[Contribution]) -> None:
    seen: set[str] = set()
    for c in contributions:
        if c.contributor in seen:
            raise ValueError(
                f"reward split: contributor {c.contributor!r} appears twice; "
                "pass one contribution per contributor per round"
            )
        seen.add(c.contributor)


def _decimal(value: object, name: str) -> Decimal:
    """`value` as a finite Decimal (ints, strings and floats via their shortest repr)."""
    try:
        d = value if isinstance(value, Decimal) else Decimal(str(value))
    except decimal.InvalidOperation:
        raise ValueError(f"reward policy: {name} must be a number, got {value!r}") from None
    if not d.is_finite():
        raise ValueError(f"reward policy: {name} must be finite, got {d}")
    return d
