"""Score a round's contributions and pay them into the ledger.

Quality of contribution i is utility(base + update_i) - utility(base) on the coordinator's
private validation set, utility = minus validation loss (`zoo_gym.scoring`, method from
`[rewards]`); leave-one-out and Shapley values aggregate coalitions with the round's rule
and its parameters, but unweighted: the round's example and trust weights are not applied
to coalitions. The pool is split in proportion to positive quality among the updates the rule used;
an update the rule left out, or one that did not help, earns zero with its reason. Every
contribution that reached aggregation gets a reward row (zero included), and the
contributor's reputation moves as an exponential moving average of its outcomes. A
contributor below `trusted_reputation` earns in proportion to its reputation (a fresh
identity: nothing while trusted contributors qualify in the same round).

Rewards are paid whether or not the round's aggregate passes the quality gate: each
contribution is judged on its own, against the same base.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from zoo_gym import ledger
from zoo_gym.aggregation import aggregate
from zoo_gym.coordinator.config import CoordinatorConfig
from zoo_gym.coordinator.strategy import RoundAggregate
from zoo_gym.ledger import Engine, Session
from zoo_gym.scoring import (
    Contribution,
    RewardPolicy,
    RewardSplit,
    round_outcomes,
    score_contributions,
    split_rewards,
    update_reputations,
)

log = logging.getLogger(__name__)


def pay_round(
    engine: Engine,
    config: CoordinatorConfig,
    *,
    round_number: int,
    agg: RoundAggregate,
    utility: Callable[[torch.Tensor], float],
    baseline: float,
) -> RewardSplit | None:
    """Score the rows of `agg`, split the pool and record one reward per contributor."""
    settings = config.rewards
    if settings.method == "none" or agg.rows is None or not agg.row_contributors:
        return None
    quality = score_contributions(
        agg.rows,
        utility=utility,
        method=settings.method,
        aggregate_fn=coalition_rule(config),
        baseline=baseline,
    )
    contributions = [
        Contribution(
            cid,
            quality=q,
            rejection=None
            if d.selected or d.weight > 0
            else f"not used by {config.aggregator}: {d.reason}",
        )
        for cid, q, d in zip(agg.row_contributors, quality.scores, agg.decisions, strict=True)
    ]
    split = record_rewards(engine, config, round_number, contributions)
    log.info(
        "round %d rewards (%s, %d utility evaluations): %s",
        round_number,
        quality.method,
        quality.utility_calls,
        split.summary,
    )
    return split


def coalition_rule(config: CoordinatorConfig) -> Callable[[torch.Tensor], torch.Tensor]:
    """The round's rule with its parameters, unweighted: (k, d) rows -> (d,) aggregate."""
    params: dict[str, Any] = dict(config.aggregator_params)

    def aggregate_fn(rows: torch.Tensor) -> torch.Tensor:
        return aggregate(
            config.aggregator, rows, f=config.byzantine_f, pre=config.pre, **params
        ).vector

    return aggregate_fn


def record_rewards(
    engine: Engine, config: CoordinatorConfig, round_number: int, contributions: list[Contribution]
) -> RewardSplit:
    """Split the round's pool among `contributions` (weighted by the contributors' reputations
    before the round) and record each reward with the reputation it leaves."""
    settings = config.rewards
    with Session(engine) as session:
        previous = {c.contributor_id: c.reputation for c in ledger.list_contributors(session)}
    policy = RewardPolicy(
        pool=settings.pool,
        min_quality=settings.min_quality,
        reputation_weight=settings.reputation_weight,
        unit=settings.unit,
        trusted_reputation=config.trusted_reputation,
    )
    split = split_rewards(contributions, policy=policy, reputations=previous)
    reputations = update_reputations(
        {c.contributor: previous.get(c.contributor, 0.0) for c in contributions},
        round_outcomes(split.rewards),
        alpha=settings.reputation_alpha,
    )
    with Session(engine) as session:
        for reward in split.rewards:
            ledger.record_reward(
                session,
                round_number=round_number,
                contributor_id=reward.contributor,
                quality=reward.quality,
                amount=reward.amount,
                reputation_after=reputations[reward.contributor],
                reason=reward.reason,
            )
    return split
