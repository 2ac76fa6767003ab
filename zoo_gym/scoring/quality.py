"""Quality of each update: its own effect (`individual`) and its marginal effect on the
round's aggregate (`leave_one_out`).

Both take the `(n, d)` updates and a utility `U` that evaluates a flat `(d,)` update applied
to the base on the coordinator's private validation set (minus validation loss for SFT,
mean reward for GRPO). Scores are in utility units; a positive score means the update helped.
"""

from __future__ import annotations

import logging
import math

from ._core import AggregateFn, Game, Quality, Utility, check_updates, require_aggregate_fn
from .rows import Updates, row_of

log = logging.getLogger(__name__)


def individual(
    updates: Updates,
    *,
    utility: Utility,
    aggregate_fn: AggregateFn | None = None,
    baseline: float | None = None,
) -> Quality:
    """Quality of each update on its own: q_i = U(x_i) - U(0).

    `updates` is (n, d); `U(x_i)` is the utility of the base with update i merged into it,
    `U(0)` that of the base (pass `baseline` when the round already evaluated it).
    `aggregate_fn` is accepted for a uniform interface and not used. A candidate whose
    utility is not finite (the update broke the model) scores -inf.

    Cost: n + 1 utility evaluations (n with `baseline`), no aggregation.
    """
    n, _ = check_updates(updates, "individual")
    game = Game(
        updates, utility=utility, aggregate_fn=None, method="individual", hint="", baseline=baseline
    )
    u0 = game.baseline()
    scores = []
    for i in range(n):
        u = game.evaluate(row_of(updates, i))
        scores.append(u - u0 if math.isfinite(u) else -math.inf)
    log.debug("individual quality of %d updates: %d utility calls", n, game.utility_calls)
    return Quality(
        method="individual",
        scores=tuple(scores),
        baseline=u0,
        aggregate_utility=None,
        utility_calls=game.utility_calls,
        aggregations=0,
    )


def leave_one_out(
    updates: Updates,
    *,
    utility: Utility,
    aggregate_fn: AggregateFn | None = None,
    baseline: float | None = None,
) -> Quality:
    """Leave-one-out quality through the round's rule: q_i = U(agg(all)) - U(agg(all \\ {i})).

    `updates` is (n, d); `aggregate_fn` applies the round's aggregation rule to a subset of
    rows, `(k, d) -> (d,)`, so q_i measures how much the round's aggregate gained from update
    i. An empty coalition is the base itself: with n = 1, q_1 = U(agg({1})) - U(0).

    Precondition: the rule must accept n - 1 updates (Krum with f Byzantine updates needs
    n - 1 >= 2f + 3); when `aggregate_fn` raises ValueError for a coalition, this raises one
    ValueError saying so. Every coalition utility must be finite.

    Cost: n + 1 utility evaluations and n + 1 aggregations (n = 1: 2 evaluations, or 1 with
    `baseline`, and 1 aggregation).
    """
    n, _ = check_updates(updates, "leave_one_out")
    game = Game(
        updates,
        utility=utility,
        aggregate_fn=require_aggregate_fn(aggregate_fn, "leave_one_out"),
        method="leave_one_out",
        hint="leave-one-out needs the rule to accept n - 1 updates: collect more updates, "
        "lower f, or use method='individual'",
        baseline=baseline,
    )
    everyone = frozenset(range(n))
    full = game.value(everyone)
    scores = tuple(full - game.value(everyone - {i}) for i in range(n))
    log.debug(
        "leave-one-out quality of %d updates: %d utility calls, %d aggregations",
        n,
        game.utility_calls,
        game.aggregations,
    )
    return Quality(
        method="leave_one_out",
        scores=scores,
        baseline=game.cache.get(frozenset()),
        aggregate_utility=full,
        utility_calls=game.utility_calls,
        aggregations=game.aggregations,
    )
