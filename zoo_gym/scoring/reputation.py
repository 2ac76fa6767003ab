"""Reputation: an exponential moving average of each contributor's round outcomes.

After a round in which contributor i took part,

    r_i <- (1 - alpha) r_i + alpha s_i,    alpha in (0, 1],

where s_i in [0, 1] is the round's normalised outcome (`round_outcomes`):

    s_i = q_i / max_j q_j   over the contributions that qualified for a reward,
    s_i = 0                 for a rejected, invalid, unscored, harmful or below-minimum one.

The round's best contribution scores 1 and the others in proportion to their quality, so s
does not depend on the utility's scale (losses and rewards differ round to round) nor on
how many took part. It uses quality, not the amount paid, so reputation weighting of rewards
does not feed back into reputation. Contributors absent from a round keep their reputation.

A newcomer starts at `initial` (default 0): a fresh identity then carries no advantage over
a bad record, which makes whitewashing (re-registering a new key) pointless.
`selection_weights` keeps a floor so newcomers are still sampled and can earn reputation.

Trust ramps influence up with reputation (`trust`, `influence_weights`): with rho the
reputation at which a contributor is fully trusted,

    t_i = min(1, r_i / rho),

so a fresh identity (r = 0) starts at t = 0 and an honest one whose contributions score
s >= s_min each round reaches t = 1 after about log(1 - rho / s_min) / log(1 - alpha)
rounds (alpha = 0.2, rho = 0.3: 2 rounds as the round's best, 5 at half its quality). Its
reward weight and its weight in a weighted rule (FedAvg, geometric median) scale with t;
k fresh identities therefore earn nothing and weigh at most k * floor / (k * floor + T)
of an average while T units of established weight take part.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from .payout import Payout

__all__ = [
    "influence_weights",
    "round_outcomes",
    "sample_contributors",
    "selection_weights",
    "trust",
    "update_reputations",
]


def round_outcomes(rewards: Sequence[Payout]) -> dict[str, float]:
    """Normalised outcome s_i in [0, 1] of each contributor in a round's reward split.

    s_i = q_i / max_j q_j over the qualifying contributions, 0 for every other one.
    """
    best = max((r.quality for r in rewards if r.qualified and r.quality is not None), default=0.0)
    return {
        r.contributor: r.quality / best
        if r.qualified and r.quality is not None and best > 0.0
        else 0.0
        for r in rewards
    }


def update_reputations(
    previous: Mapping[str, float],
    outcomes: Mapping[str, float],
    *,
    alpha: float = 0.2,
    initial: float = 0.0,
) -> dict[str, float]:
    """New reputations after one round: r <- (1 - alpha) r + alpha s for each contributor in
    `outcomes`; contributors only in `previous` keep theirs.

    `previous` and `outcomes` map contributor -> value in [0, 1]; a contributor without a
    previous reputation starts from `initial` in [0, 1]. alpha in (0, 1] is the weight of the
    newest round (alpha = 1 forgets everything before it). Returns every contributor of
    either mapping, previous ones first.
    """
    if not 0.0 < _number(alpha) <= 1.0:
        raise ValueError(f"reputation: alpha must be in (0, 1], got {alpha}")
    _check_unit("initial reputation", initial)
    for name, value in previous.items():
        _check_unit(f"reputation of {name!r}", value)
    for name, value in outcomes.items():
        _check_unit(f"outcome of {name!r}", value)
    updated = dict(previous)
    for name, s in outcomes.items():
        r = previous.get(name, initial)
        updated[name] = (1.0 - alpha) * r + alpha * s
    return updated


def selection_weights(reputations: Mapping[str, float], *, floor: float = 0.05) -> dict[str, float]:
    """Sampling probabilities for the next round from reputations in [0, 1].

    w_i = max(r_i, floor) / sum_j max(r_j, floor). The floor in (0, 1] gives newcomers and
    contributors recovering from a bad round a chance to be picked (exploration); a
    contributor with reputation r >= floor is picked r / floor times as often as one at the
    floor. The weights sum to 1.
    """
    if not (math.isfinite(floor) and 0.0 < floor <= 1.0):
        raise ValueError(f"selection weights: floor must be in (0, 1], got {floor}")
    for name, value in reputations.items():
        _check_unit(f"reputation of {name!r}", value)
    raw = {name: max(float(r), floor) for name, r in reputations.items()}
    total = sum(raw.values())
    return {name: w / total for name, w in raw.items()}


def sample_contributors(
    reputations: Mapping[str, float],
    k: int,
    *,
    floor: float = 0.05,
    generator: torch.Generator | None = None,
) -> list[str]:
    """Draw k distinct contributors with probabilities `selection_weights(reputations, floor)`.

    Sequential sampling without replacement (each draw renormalises over those left). With
    k >= the number of contributors, returns all of them in the mapping's order. Pass a
    seeded `torch.Generator` for a reproducible draw.
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"sample_contributors: k must be an int >= 0, got {k!r}")
    weights = selection_weights(reputations, floor=floor)
    names = list(weights)
    if k >= len(names):
        return names
    if k == 0:
        return []
    probs = torch.tensor([weights[n] for n in names], dtype=torch.float64)  # (n,)
    picked = torch.multinomial(probs, k, replacement=False, generator=generator)  # (k,)
    return [names[int(i)] for i in picked]


def trust(reputation: float, *, trusted_at: float) -> float:
    """t = min(1, r / rho) for reputation r in [0, 1] and rho = `trusted_at` in [0, 1];
    rho = 0 trusts everyone (t = 1).

    >>> trust(0.0, trusted_at=0.3), trust(0.15, trusted_at=0.3), trust(0.9, trusted_at=0.3)
    (0.0, 0.5, 1.0)
    """
    _check_unit("reputation", reputation)
    _check_unit("trusted_at", trusted_at)
    return 1.0 if trusted_at == 0.0 else min(1.0, float(reputation) / trusted_at)


def influence_weights(
    examples: Sequence[float],
    reputations: Sequence[float],
    *,
    trusted_at: float,
    floor: float,
) -> list[float]:
    """Aggregation weights of n updates from their claimed example counts and reputations.

    w_i = e_i * max(t_i, floor)  with t_i = trust(r_i), e_i the example count update i claims,
    capped at the round's median claim when t_i < 1 (an untrusted contributor cannot weigh
    more by claiming more). When nobody in the round is trusted at all (every t_i = 0, e.g. a
    new network), t_i = 1 for every update: there is no established weight to protect, and
    the median cap still applies. `floor` in (0, 1] keeps fresh updates in the average (and
    so scoreable). Returns n weights >= 0, not normalised.
    """
    if len(examples) != len(reputations):
        raise ValueError("influence weights: pass one reputation per update")
    if not (math.isfinite(floor) and 0.0 < floor <= 1.0):
        raise ValueError(f"influence weights: floor must be in (0, 1], got {floor}")
    t = [trust(r, trusted_at=trusted_at) for r in reputations]
    if not any(t):
        t = [0.0] * len(t)  # nobody established: everyone equally untrusted, weighted alike
        factors = [1.0] * len(t)
    else:
        factors = [max(ti, floor) for ti in t]
    claims = sorted(float(e) for e in examples)
    cap = claims[(len(claims) - 1) // 2] if claims else 0.0  # the lower median
    return [
        (float(e) if ti >= 1.0 else min(float(e), cap)) * f
        for e, ti, f in zip(examples, t, factors, strict=True)
    ]


def _check_unit(what: str, value: float) -> None:
    if not 0.0 <= _number(value) <= 1.0:
        raise ValueError(f"reputation: {what} must be a number in [0, 1], got {value!r}")


def _number(value: object) -> float:
    """`value` as a float, NaN when it is not a real number (so every range check fails)."""
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return math.nan
