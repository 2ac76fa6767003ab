"""Shared pieces of the quality methods: the callables they take, the result type, and a
cached coalition game over the rows of one `(n, d)` tensor of updates.

A *utility* `U` maps a flat `(d,)` update to a float: the coordinator merges the update into
the base model and evaluates it on its private validation set (minus validation loss for
SFT, mean reward for GRPO). `U(0)` is the utility of the base itself. An *aggregate_fn*
applies the round's aggregation rule to a subset of rows `(k, d)` and returns the `(d,)`
aggregate, so every coalition is merged exactly the way the round merged everyone. A
*gradient* returns grad U(0), the gradient of the utility at the base with respect to the
update's own coordinates `(d,)`; computing it costs the coordinator one backward pass.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .rows import ColumnSource, Updates, select_rows, shape_of

__all__ = ["AggregateFn", "Gradient", "Quality", "Utility"]

#: evaluates a flat `(d,)` update applied to the base; higher is better
Utility = Callable[[Tensor], float]
#: the round's aggregation rule applied to a subset of rows (a tensor or a view of a source):
#: `(k, d)` -> `(d,)`
AggregateFn = Callable[[Updates], Tensor]
#: grad U(0) in the update's coordinates `(d,)`: one forward and backward pass at the base
Gradient = Callable[[], Tensor]


@dataclass(frozen=True)
class Quality:
    """The quality of each update of a round and what computing it cost.

    `scores` holds one value per row of the updates, in input order, in utility units
    (a positive score means the update helped). `baseline` is `U(0)` and `aggregate_utility`
    is `U(agg(all rows))`, each None where the method did not need it. `utility_calls` and
    `aggregations` count the evaluations actually made (cached coalitions count once, and
    evaluations spent before a time budget ran out count too); `backward_passes` the
    gradients computed (`first_order`: one, whatever n); `seconds` the wall time of the whole
    scoring (set by `score_contributions`). `permutations` and `converged` describe the Monte
    Carlo methods. `fallback_from` names the method that ran out of its time budget when the
    scores come from the fallback (`method` is then "first_order"), else "". `note` says in
    one line anything a reader of the ledger should know (a truncated round, a fallback).
    """

    method: str
    scores: tuple[float, ...]  # (n,)
    baseline: float | None
    aggregate_utility: float | None
    utility_calls: int
    aggregations: int
    permutations: int = 0
    converged: bool = True
    note: str = ""
    backward_passes: int = 0
    seconds: float = 0.0
    fallback_from: str = ""


def check_updates(updates: Updates, method: str) -> tuple[int, int]:
    """Return `(n, d)` of floating updates (an `(n, d)` tensor or a column source) with
    n, d >= 1, or raise ValueError."""
    if (isinstance(updates, Tensor) and updates.dim() != 2) or not isinstance(
        updates, Tensor | ColumnSource
    ):
        shape = tuple(updates.shape) if isinstance(updates, Tensor) else type(updates).__name__
        raise ValueError(
            f"{method}: updates must be one (n, d) tensor or column source, got {shape}; "
            "flatten each update and stack them"
        )
    if not updates.dtype.is_floating_point:
        raise ValueError(f"{method}: updates must be floating point, got {updates.dtype}")
    n, d = shape_of(updates)
    if n < 1 or d < 1:
        raise ValueError(f"{method}: need at least one update of at least one coordinate")
    return int(n), int(d)


def require_aggregate_fn(aggregate_fn: AggregateFn | None, method: str) -> AggregateFn:
    """Return `aggregate_fn`, or raise ValueError naming what to pass."""
    if aggregate_fn is None:
        raise ValueError(
            f"{method} needs aggregate_fn: the round's aggregation rule applied to a subset "
            "of rows, (k, d) -> (d,)"
        )
    return aggregate_fn


class Game:
    """The coalition game v(C) = U(agg(updates[C])), v(empty) = U(0), with a cache.

    Each distinct coalition is aggregated and evaluated once; `utility_calls` and
    `aggregations` count what was actually computed. `hint` ends the error raised when the
    aggregation rule refuses a coalition (for example one smaller than the rule's minimum).
    """

    def __init__(
        self,
        updates: Updates,  # (n, d)
        *,
        utility: Utility,
        aggregate_fn: AggregateFn | None,
        method: str,
        hint: str,
        baseline: float | None = None,
    ) -> None:
        self.updates = updates
        self.n, self.d = shape_of(updates)
        self.utility = utility
        self.aggregate_fn = aggregate_fn
        self.method = method
        self.hint = hint
        self.utility_calls = 0
        self.aggregations = 0
        self.cache: dict[frozenset[int], float] = {}
        if baseline is not None:
            self.cache[frozenset()] = check_baseline(baseline, method)

    def evaluate(self, vector: Tensor) -> float:
        """U(vector) as a float (one utility call)."""
        self.utility_calls += 1
        return float(self.utility(vector))

    def baseline(self) -> float:
        """U(0): the utility of the base itself; must be finite."""
        key: frozenset[int] = frozenset()
        if key not in self.cache:
            zero = torch.zeros(self.d, dtype=torch.float32, device=self.updates.device)  # (d,)
            self.cache[key] = check_baseline(self.evaluate(zero), self.method)
        return self.cache[key]

    def aggregate(self, rows: frozenset[int]) -> Tensor:
        """agg(updates[rows]) `(d,)`, with the rule's refusal turned into one clear error."""
        fn = require_aggregate_fn(self.aggregate_fn, self.method)
        self.aggregations += 1
        try:
            vector = fn(select_rows(self.updates, sorted(rows)))  # (k, d) -> (d,)
        except ValueError as exc:
            raise ValueError(
                f"{self.method}: the aggregation rule cannot aggregate a coalition of "
                f"{len(rows)} of the {self.n} updates ({exc}); {self.hint}"
            ) from exc
        if not isinstance(vector, Tensor) or tuple(vector.shape) != (self.d,):
            shape = tuple(vector.shape) if isinstance(vector, Tensor) else type(vector).__name__
            raise ValueError(
                f"{self.method}: aggregate_fn must return a ({self.d},) tensor, got {shape}"
            )
        return vector

    def value(self, rows: frozenset[int]) -> float:
        """v(rows) = U(agg(updates[rows])); v(empty) = U(0). Must be finite."""
        if not rows:
            return self.baseline()
        if rows not in self.cache:
            u = self.evaluate(self.aggregate(rows))
            if not math.isfinite(u):
                raise ValueError(
                    f"{self.method}: the utility of a coalition of {len(rows)} updates is {u}; "
                    "an update breaks the model: screen it out first (the aggregation rule or "
                    "method='individual') before computing coalition values"
                )
            self.cache[rows] = u
        return self.cache[rows]


def check_baseline(value: float, method: str) -> float:
    """Return U(0) as a float, or raise ValueError when it is not finite."""
    u = float(value)
    if not math.isfinite(u):
        raise ValueError(
            f"{method}: the utility of the base itself is {u}; check the validation set and "
            "the utility function before scoring updates"
        )
    return u
