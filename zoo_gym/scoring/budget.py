"""Bounds on what scoring one round costs: a validation subset and a time budget.

`validation_subset` picks the records every evaluation of one round uses: a fixed, seeded
sample, so the cost of an evaluation does not grow with the validation set and every method
of the round sees the same records. `Budget` wraps a utility so that no evaluation starts
after the round's time budget: the next one raises `OutOfTime`, which `score_contributions`
turns into its fallback (see `zoo_gym.scoring.dispatch`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ._core import AggregateFn, Utility
from .rows import Updates

__all__ = ["Budget", "OutOfTime", "validation_subset"]


class OutOfTime(Exception):
    """The time budget ran out before the next evaluation."""


@dataclass
class Budget:
    """A time budget of `seconds` (None: unbounded) from `started` (`time.perf_counter`).

    `utility(U)` returns U that refuses to start an evaluation once the budget is spent
    (raises `OutOfTime`), so a method overruns the budget by at most one evaluation.
    `utility_calls` and `aggregations` count what the wrapped callables actually ran.
    """

    seconds: float | None
    started: float = field(default_factory=time.perf_counter)
    utility_calls: int = 0
    aggregations: int = 0

    def spent(self) -> bool:
        """Whether the budget has run out."""
        return self.seconds is not None and time.perf_counter() - self.started >= self.seconds

    def utility(self, utility: Utility) -> Utility:
        def bounded(vector: Tensor) -> float:
            if self.spent():
                raise OutOfTime
            self.utility_calls += 1
            return utility(vector)

        return bounded

    def aggregate_fn(self, aggregate_fn: AggregateFn | None) -> AggregateFn | None:
        if aggregate_fn is None:
            return None
        fn = aggregate_fn

        def counted(rows: Updates) -> Tensor:
            self.aggregations += 1
            return fn(rows)

        return counted


def validation_subset(size: int, examples: int, *, seed: int) -> tuple[int, ...]:
    """Indices of the `examples` records (of `size`) one round's evaluations use, ascending.

    Every index, 0 .. size - 1, when `examples` >= `size`; otherwise a uniform sample without
    replacement from `torch.randperm` with a CPU generator seeded `seed`: the same indices for
    the same seed on every machine.
    """
    if size < 1 or examples < 1:
        raise ValueError(
            f"validation_subset: need at least one record and one example, got {size} records "
            f"and {examples} examples"
        )
    if examples >= size:
        return tuple(range(size))
    generator = torch.Generator(device="cpu").manual_seed(seed)
    picked = torch.randperm(size, generator=generator)[:examples]
    return tuple(sorted(int(i) for i in picked))
