"""Quality of each contribution, the reward split and reputation. Pure: no I/O.

Quality (`score_contributions`, one function per method in `METHODS`): the coordinator
supplies a utility `U`, which merges a flat `(d,)` update into the base and evaluates it on
the private validation set (minus validation loss for SFT, mean reward for GRPO), and, for
the methods that need it, `aggregate_fn`, the round's own aggregation rule applied to a
subset of the `(n, d)` updates. Methods:

- `individual` (default): q_i = U(x_i) - U(0); n + 1 evaluations.
- `leave_one_out`: q_i = U(agg(all)) - U(agg(all \\ {i})); n + 1 evaluations and aggregations.
- `gtg_shapley`: Shapley values of v(C) = U(agg(C)) by guided, truncated Monte Carlo
  [Liu et al., 2022]; `exact_shapley` enumerates all 2^n coalitions for small n.
- `first_order`: q_i = grad U(0) . x_i, the first-order estimate of `individual`; one
  backward pass at the base for all n (`gradient`; `update_gradient` maps the gradient
  with respect to the base's weights to the update's coordinates, FFA-LoRA's B included).

Cost bounds (`budget`): `validation_subset` picks the fixed, seeded records a round's
evaluations use; `score_contributions(..., seconds=...)` stops a method whose evaluations
outrun the time budget and scores the whole round by `first_order` instead, saying so in
`Quality.fallback_from` and `Quality.note`. Every `Quality` reports its cost: evaluations,
aggregations, backward passes and seconds.

Rewards (`split_rewards`): the round's pool is split in proportion to positive quality among
accepted contributions above a minimum, in exact decimal units that sum to the pool; every
zero carries a one-line reason. Reputation (`update_reputations`): an exponential moving
average of each round's normalised outcome (`round_outcomes`); `selection_weights` and
`sample_contributors` turn reputations into sampling probabilities for the next rounds;
`trust` and `influence_weights` ramp a fresh identity's reward and aggregation weight up
from zero as its reputation grows.
"""

from ._core import AggregateFn, Gradient, Quality, Utility
from .budget import validation_subset
from .dispatch import METHODS, score_contributions
from .payout import Contribution, Payout, RewardPolicy, RewardSplit, split_rewards
from .quality import individual, leave_one_out
from .reputation import (
    influence_weights,
    round_outcomes,
    sample_contributors,
    selection_weights,
    trust,
    update_reputations,
)
from .shapley import exact_shapley, gtg_shapley
from .taylor import first_order, update_gradient

__all__ = [
    "METHODS",
    "AggregateFn",
    "Contribution",
    "Gradient",
    "Payout",
    "Quality",
    "RewardPolicy",
    "RewardSplit",
    "Utility",
    "exact_shapley",
    "first_order",
    "gtg_shapley",
    "individual",
    "influence_weights",
    "leave_one_out",
    "round_outcomes",
    "sample_contributors",
    "score_contributions",
    "selection_weights",
    "split_rewards",
    "trust",
    "update_gradient",
    "update_reputations",
    "validation_subset",
]
