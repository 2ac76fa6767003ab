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

Cost bounds (`[rewards]`): every evaluation uses the round's validation subset
(`scoring_examples` records drawn from the round's seed) and scoring stops once
`scoring_seconds` are spent: the round's contributions are then all scored by `first_order`
(one backward pass), and the log and the round's summary say so. `RoundScorer` merges and
evaluates candidates on the evaluator's device (the coordinator's `device`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from zoo_gym import ledger
from zoo_gym.aggregation import aggregate
from zoo_gym.coordinator.config import CoordinatorConfig, TrainingPolicy
from zoo_gym.coordinator.evaluation import Evaluator
from zoo_gym.coordinator.strategy import RoundAggregate
from zoo_gym.core.delta import Layout, unflatten
from zoo_gym.core.lora import LoraSpec, frozen_a, is_carry, module_of, stored
from zoo_gym.core.protocol import POLICY_OBJECTIVES
from zoo_gym.ledger import Engine, Session
from zoo_gym.scoring import (
    Contribution,
    Quality,
    RewardPolicy,
    RewardSplit,
    round_outcomes,
    score_contributions,
    split_rewards,
    update_gradient,
    update_reputations,
    validation_subset,
)
from zoo_gym.scoring.rows import Updates

log = logging.getLogger(__name__)


class RoundScorer:
    """U(v) and grad U(0) of one round's candidates, on the evaluator's device.

    U(v) is minus the validation loss (SFT) or the mean validation reward (GRPO / GSPO) of the
    base with the flat `(d,)` update v merged in, on the round's validation subset (`examples`
    records drawn with `subset_seed`; the whole set when it is smaller, and then `baseline`,
    U(0) on the whole set, is kept; otherwise the method evaluates U(0) on the subset). Each
    candidate is merged into the evaluation model's own weights, in place and on its device
    (`Evaluator.editing`): the weights the update touches are reset to the base, then FFA-LoRA
    adds s B A with the round's frozen A (from `seed`, kept on the device), one module's
    `(out, in)` delta at a time, and the dense adapters add their delta; each sum is formed in
    float32 and rounded to the base weight's dtype, as `merge_update` merges into the base.
    The rest of the model holds the base, loaded once before the first evaluation: the
    evaluator is the round loop's own and nothing else changes it while the round is scored.

    `gradient()` is grad U(0) in the update's coordinates from one forward and backward pass
    of the validation loss at the base (`Evaluator.loss_gradient`, then `update_gradient`).
    For GRPO / GSPO it is the gradient of minus the loss of the validation answers, a
    differentiable stand-in for the reward.
    """

    def __init__(
        self,
        evaluator: Evaluator,
        training: TrainingPolicy,
        state: dict[str, torch.Tensor],
        layout: Layout,
        spec: LoraSpec,
        *,
        seed: int,
        subset_seed: int,
        examples: int,
        baseline: float | None,
        carry_seed: int | None = None,
    ) -> None:
        indices = validation_subset(len(evaluator.records), examples, seed=subset_seed)
        whole = len(indices) == len(evaluator.records)
        self.evaluator = evaluator if whole else evaluator.subset(indices)
        self.baseline = baseline if whole else None
        self.training, self.state, self.layout, self.spec = training, state, layout, spec
        self.seed, self.carry_seed = seed, carry_seed
        ffa = training.adapter == "ffa_lora"
        # update entry -> the base weight it changes
        self.weights = {e.name: module_of(e.name) + ".weight" if ffa else e.name for e in layout}
        self._groups: dict[str, list[str]] = {}  # base weight -> its entries, in layout order
        for key, name in self.weights.items():
            self._groups.setdefault(name, []).append(key)
        self._a: dict[str, torch.Tensor] = {}  # entry -> its frozen A (r, in), on the device
        self._prepared = False

    def utility(self, vector: torch.Tensor) -> float:
        self._prepare()
        update = unflatten(vector.to(self.evaluator.device, torch.float32), self.layout)
        touched = {name: self.state[name] for name in self.weights.values()}
        with self.evaluator.editing(touched) as weights:
            self._merge_into(weights, update)
            t = self.training
            if t.method in POLICY_OBJECTIVES:
                return self.evaluator.mean_reward(
                    None, reward_functions=t.reward_functions, max_new_tokens=t.max_new_tokens
                )
            return -self.evaluator.loss(None)

    def gradient(self) -> torch.Tensor:
        """grad U(0) `(d,)` float32 on the device: one backward pass at the base."""
        names = sorted(set(self.weights.values()))
        _, grads = self.evaluator.loss_gradient(self.state, names)  # d loss / dW
        return update_gradient(
            {name: -g for name, g in grads.items()},
            self.layout,
            adapter=self.training.adapter,
            spec=self.spec,
            seed=self.seed,
            carry_seed=self.carry_seed,
        )

    def _merge_into(
        self, weights: dict[str, torch.Tensor], update: dict[str, torch.Tensor]
    ) -> None:
        """Add `update` to the model's `weights` (the touched ones hold the base), in place,
        one weight's delta at a time (FFA-LoRA: its B's and, carried, its B_carry's)."""
        with torch.no_grad():
            for name, keys in self._groups.items():
                delta = self._delta(keys[0], update[keys[0]])
                for key in keys[1:]:
                    delta = delta + self._delta(key, update[key])
                weight = weights[name]
                weight.copy_((weight.float() + delta).to(self.state[name].dtype))

    def _delta(self, key: str, value: torch.Tensor) -> torch.Tensor:
        """The weight-space delta of update entry `key` in its weight's stored shape."""
        if self.training.adapter != "ffa_lora":
            return value
        module = module_of(key)
        return stored(self.spec.scaling * (value @ self._a[key]), module, self.spec)  # (out, in)

    def _a_seed(self, key: str) -> int:
        """The seed of the A that entry `key` is merged with."""
        if not is_carry(key):
            return self.seed
        if self.carry_seed is None:
            raise ValueError(f"{key}: a carried B needs the seed of the previous epoch's A")
        return self.carry_seed

    def _prepare(self) -> None:
        """On first use: load the whole base into the model (the weights no update touches
        stay so) and put the frozen A of every FFA-LoRA entry on the device (the round's A;
        for a carried B, the previous epoch's)."""
        if self._prepared:
            return
        self.evaluator.load(self.state)
        if self.training.adapter == "ffa_lora":
            for key, name in self.weights.items():
                module, weight = module_of(key), self.state[name]
                columns = weight.shape[0 if module in self.spec.fan_in_fan_out else 1]
                a = frozen_a(self._a_seed(key), module, int(columns), self.spec.rank)  # (r, in)
                self._a[key] = a.to(self.evaluator.device)
        self._prepared = True


def pay_round(
    engine: Engine,
    config: CoordinatorConfig,
    *,
    round_number: int,
    agg: RoundAggregate,
    scorer: RoundScorer,
) -> tuple[RewardSplit, Quality] | None:
    """Score the rows of `agg` within the round's budget, split the pool and record one
    reward per contributor; the split and the quality (with its cost), or None when the
    round is not scored."""
    settings = config.rewards
    if settings.method == "none" or agg.rows is None or not agg.row_contributors:
        return None
    quality = score_contributions(
        agg.rows,
        utility=scorer.utility,
        method=settings.method,
        aggregate_fn=coalition_rule(config),
        baseline=scorer.baseline,
        gradient=scorer.gradient,
        seconds=settings.scoring_seconds or None,
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
        "round %d rewards (%s: %d evaluations, %d backward passes, %.1f s%s): %s",
        round_number,
        quality.method,
        quality.utility_calls,
        quality.backward_passes,
        quality.seconds,
        f"; {quality.note}" if quality.note else "",
        split.summary,
    )
    return split, quality


def coalition_rule(config: CoordinatorConfig) -> Callable[[Updates], torch.Tensor]:
    """The round's rule with its parameters, unweighted: (k, d) rows (a tensor, or a view of
    a column source) -> (d,) aggregate."""
    params: dict[str, Any] = dict(config.aggregator_params)

    def aggregate_fn(rows: Updates) -> torch.Tensor:
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
