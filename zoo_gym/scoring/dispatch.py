"""One entry point for every quality method: `score_contributions(updates, utility=..., method=...)`.

`METHODS` maps a method name to its function with the uniform signature
`(updates, *, utility, aggregate_fn, baseline, **params) -> Quality`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor

from ._core import AggregateFn, Quality, Utility
from .quality import individual, leave_one_out
from .shapley import exact_shapley, gtg_shapley

METHODS: dict[str, Callable[..., Quality]] = {
    "individual": individual,
    "leave_one_out": leave_one_out,
    "gtg_shapley": gtg_shapley,
    "exact_shapley": exact_shapley,
}


def score_contributions(
    updates: Tensor,
    *,
    utility: Utility,
    method: str = "individual",
    aggregate_fn: AggregateFn | None = None,
    baseline: float | None = None,
    **params: Any,
) -> Quality:
    """Quality of each row of the `(n, d)` updates with `method`.

    `utility` evaluates a flat `(d,)` update applied to the base (higher is better);
    `aggregate_fn` is the round's rule applied to a subset of rows, `(k, d) -> (d,)`, needed
    by every method but `individual`; `baseline` is U(0) when already known. `params` go to
    the method (`seed`, `max_permutations`, ... for `gtg_shapley`).
    """
    if method not in METHODS:
        raise ValueError(f"unknown quality method {method!r}; choose one of {', '.join(METHODS)}")
    return METHODS[method](
        updates, utility=utility, aggregate_fn=aggregate_fn, baseline=baseline, **params
    )
