"""One entry point for every quality method: `score_contributions(updates, utility=..., method=...)`.

`METHODS` maps a method name to its function with the uniform signature
`(updates, *, utility, aggregate_fn, baseline, **params) -> Quality`.

Time budget and fallback: with `seconds` set, no utility evaluation starts once `seconds` have
passed since scoring began (a method overruns by at most one evaluation). The method then
stops, its partial results are dropped, and every contribution of the round is scored by
`first_order` from `gradient` (one backward pass). The rule is deterministic: the scores of a
round that ran out do not depend on when it ran out, and all contributions of a round are
scored by one method, so a reward split in proportion to quality never compares an exact
score with an estimate. The result says so (`Quality.fallback_from`, `Quality.note`) and its
cost counts the evaluations spent before the budget ran out. `first_order` itself costs one
backward pass and is not interrupted.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from ._core import AggregateFn, Gradient, Quality, Utility
from .budget import Budget, OutOfTime
from .quality import individual, leave_one_out
from .rows import Updates
from .shapley import exact_shapley, gtg_shapley
from .taylor import first_order

log = logging.getLogger(__name__)

METHODS: dict[str, Callable[..., Quality]] = {
    "individual": individual,
    "leave_one_out": leave_one_out,
    "gtg_shapley": gtg_shapley,
    "exact_shapley": exact_shapley,
    "first_order": first_order,
}


def score_contributions(
    updates: Updates,
    *,
    utility: Utility,
    method: str = "individual",
    aggregate_fn: AggregateFn | None = None,
    baseline: float | None = None,
    gradient: Gradient | None = None,
    seconds: float | None = None,
    **params: Any,
) -> Quality:
    """Quality of each row of the `(n, d)` updates with `method`, within `seconds`.

    `utility` evaluates a flat `(d,)` update applied to the base (higher is better);
    `aggregate_fn` is the round's rule applied to a subset of rows, `(k, d) -> (d,)`, needed
    by `leave_one_out` and the Shapley methods; `baseline` is U(0) when already known;
    `gradient` returns grad U(0) in the update's coordinates `(d,)`, needed by `first_order`
    and by the fallback. `seconds` (None: no limit) bounds the time spent on utility
    evaluations; when it runs out every score comes from `first_order` (module docstring).
    `params` go to the method (`seed`, `max_permutations`, ... for `gtg_shapley`). The
    result's `seconds` is the wall time of the whole call.
    """
    if method not in METHODS:
        raise ValueError(f"unknown quality method {method!r}; choose one of {', '.join(METHODS)}")
    if seconds is not None and (not math.isfinite(seconds) or seconds < 0):
        raise ValueError(f"seconds must be a finite number >= 0 or None, got {seconds}")
    if seconds is not None and gradient is None:
        raise ValueError(
            "a time budget (seconds) needs gradient: when the budget runs out the round is "
            "scored by first_order; pass gradient or seconds=None"
        )
    budget = Budget(seconds)
    if method == "first_order":
        quality = first_order(updates, baseline=baseline, gradient=gradient, **params)
    else:
        quality = _bounded(
            updates, method, budget, utility, aggregate_fn, baseline, gradient, params
        )
    return replace(quality, seconds=time.perf_counter() - budget.started)


def _bounded(
    updates: Updates,
    method: str,
    budget: Budget,
    utility: Utility,
    aggregate_fn: AggregateFn | None,
    baseline: float | None,
    gradient: Gradient | None,
    params: dict[str, Any],
) -> Quality:
    """`method` with every evaluation checked against `budget`; `first_order` once it runs out."""
    try:
        return METHODS[method](
            updates,
            utility=budget.utility(utility),
            aggregate_fn=budget.aggregate_fn(aggregate_fn),
            baseline=baseline,
            **params,
        )
    except OutOfTime:
        pass
    log.warning(
        "%s ran out of its %g s scoring budget after %d evaluations; scoring every "
        "contribution by first_order",
        method,
        budget.seconds,
        budget.utility_calls,
    )
    estimate = first_order(updates, baseline=baseline, gradient=gradient)
    return replace(
        estimate,
        utility_calls=budget.utility_calls,
        aggregations=budget.aggregations,
        fallback_from=method,
        note=f"{method} ran out of the {budget.seconds:g} s scoring budget after "
        f"{budget.utility_calls} evaluations; every contribution scored by first_order",
    )
