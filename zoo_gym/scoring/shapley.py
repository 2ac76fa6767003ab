"""Shapley values of the updates in the coalition game of one round.

The game: v(C) = U(agg(updates[C])) for a non-empty coalition C of rows, v(empty) = U(0),
with `agg` the round's aggregation rule and `U` the validation utility. The Shapley value

    phi_i = sum over S in N \\ {i} of |S|! (n - |S| - 1)! / n! * (v(S + {i}) - v(S))

is the mean marginal contribution of i over all n! orders in which the updates could join
[Shapley, 1953]. It is efficient (sum_i phi_i = v(N) - v(empty)), symmetric, and in an
additive game every player's value is its own worth.

`gtg_shapley` estimates it by Monte Carlo over permutations with truncation [Liu et al.,
2022, "GTG-Shapley: Efficient and Accurate Participant Contribution Evaluation in Federated
Learning", ACM TIST 13(4)]; `exact_shapley` enumerates all 2^n coalitions for small n.

GTG-Shapley, with v_0 = U(0) and v_N = U(agg(all)):

- between-round truncation: if |v_N - v_0| <= `between_round_tol`, the round changed
  nothing worth dividing and every score is 0;
- guided sampling: permutations come in blocks of n; in block b the k-th permutation puts
  update k first and orders the others at random (seeded `torch.Generator`), so every
  update leads equally often;
- within-round truncation: walking a permutation, once |v_N - v(prefix)| <
  `within_round_tol` the remaining updates get marginal 0 without an evaluation;
- phi_i is the running mean of update i's marginal v(prefix + {i}) - v(prefix).

Convergence: after at least `min_permutations` (checked at the end of each block), stop
when the last `window` running estimates all lie within `tolerance` of the newest one in
relative L1 norm, max_k ||phi^(k) - phi^(K)||_1 / ||phi^(K)||_1 < tolerance. (The paper
follows Ghorbani and Zou, 2019, with a per-player relative error; the vector norm keeps a
player whose value is near zero from blocking convergence.) Stop anyway after
`max_permutations`. Tolerances are absolute, in utility units; with both at 0 nothing is
truncated and every permutation is exactly efficient.

`exact_when_complete` (an addition to the paper's algorithm): once the cache holds all 2^n
coalitions (small n, no truncation hit), more permutations cannot cost another evaluation,
so sampling stops and the exact Shapley values come from the cached utilities.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from ._core import AggregateFn, Game, Quality, Utility, check_updates, require_aggregate_fn
from .rows import Updates

log = logging.getLogger(__name__)

_HINT = (
    "Shapley values need every non-empty coalition to aggregate: pass an aggregate_fn that "
    "handles small coalitions (for example a lower f for them) or use method='individual'"
)


@dataclass(frozen=True)
class _GtgOptions:
    """GTG-Shapley's truncation tolerances and stopping rule (see the module docstring)."""

    between_round_tol: float
    within_round_tol: float
    tolerance: float
    window: int
    min_permutations: int
    max_permutations: int
    exact_when_complete: bool

    def __post_init__(self) -> None:
        for name in ("between_round_tol", "within_round_tol"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"gtg_shapley: {name} must be a finite number >= 0, got {value}")
        if not math.isfinite(self.tolerance) or self.tolerance <= 0:
            raise ValueError(
                f"gtg_shapley: tolerance must be a finite number > 0, got {self.tolerance}"
            )
        for name in ("window", "min_permutations", "max_permutations"):
            count = getattr(self, name)
            if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                raise ValueError(f"gtg_shapley: {name} must be an int >= 1, got {count!r}")


@dataclass(frozen=True)
class _Estimate:
    """Where the sampling ended: scores `(n,)`, permutations walked, whether it settled."""

    scores: tuple[float, ...]
    permutations: int = 0
    converged: bool = True
    note: str = ""


def gtg_shapley(
    updates: Updates,
    *,
    utility: Utility,
    aggregate_fn: AggregateFn | None = None,
    baseline: float | None = None,
    seed: int = 0,
    between_round_tol: float = 1e-3,
    within_round_tol: float = 1e-3,
    tolerance: float = 0.05,
    window: int = 10,
    min_permutations: int = 30,
    max_permutations: int = 500,
    exact_when_complete: bool = True,
) -> Quality:
    """Guided Truncation Gradient Shapley [Liu et al., 2022] of the `(n, d)` updates.

    The algorithm, its truncations and its stopping rule are in the module docstring;
    `Quality.converged` says whether the estimate settled before `max_permutations`.
    `aggregate_fn` applies the round's rule to a subset of rows `(k, d) -> (d,)` and must
    accept every non-empty coalition; coalition utilities must be finite.

    Cost: 2 utility evaluations (v_0, v_N; 1 with `baseline`) plus one per distinct coalition
    visited, at most min((n - 1) P, 2^n - 2) for P permutations, and one aggregation per
    evaluated non-empty coalition. Results are identical for the same seed.
    """
    n, _ = check_updates(updates, "gtg_shapley")
    options = _GtgOptions(
        between_round_tol=between_round_tol,
        within_round_tol=within_round_tol,
        tolerance=tolerance,
        window=window,
        min_permutations=min_permutations,
        max_permutations=max_permutations,
        exact_when_complete=exact_when_complete,
    )
    game = Game(
        updates,
        utility=utility,
        aggregate_fn=require_aggregate_fn(aggregate_fn, "gtg_shapley"),
        method="gtg_shapley",
        hint=_HINT,
        baseline=baseline,
    )
    v0, v_all = game.baseline(), game.value(frozenset(range(n)))
    estimate = _estimate(game, v0, v_all, seed, options)
    return Quality(
        method="gtg_shapley",
        scores=estimate.scores,
        baseline=v0,
        aggregate_utility=v_all,
        utility_calls=game.utility_calls,
        aggregations=game.aggregations,
        permutations=estimate.permutations,
        converged=estimate.converged,
        note=estimate.note,
    )


def _estimate(game: Game, v0: float, v_all: float, seed: int, options: _GtgOptions) -> _Estimate:
    """Every score 0 when the round moved the utility by no more than `between_round_tol`
    (between-round truncation), else the sampled estimate."""
    if abs(v_all - v0) <= options.between_round_tol:
        return _Estimate(
            scores=(0.0,) * game.n,
            note=f"between-round truncation: the aggregate changed the utility by "
            f"{v_all - v0:.4g}, within {options.between_round_tol:g}; every score is 0",
        )
    return _sample_permutations(game, v0, v_all, seed, options)


def _sample_permutations(
    game: Game, v0: float, v_all: float, seed: int, options: _GtgOptions
) -> _Estimate:
    """Walk guided permutations, a block of n at a time, until `options` says to stop."""
    n = game.n
    generator = torch.Generator().manual_seed(seed)
    marginals: list[list[float]] = []  # (P, n)
    converged = exact = False
    while len(marginals) < options.max_permutations and not converged:
        for first in range(n):
            if len(marginals) >= options.max_permutations:
                break
            order = _guided_permutation(n, first, generator)
            marginals.append(_walk(game, order, v0, v_all, options.within_round_tol))
        exact = options.exact_when_complete and len(game.cache) == 1 << n
        converged = exact or (
            len(marginals) >= options.min_permutations
            and _converged(marginals, options.window, options.tolerance)
        )
    log.debug(
        "gtg-shapley over %d updates: %d permutations (converged %s), %d utility calls",
        n,
        len(marginals),
        converged,
        game.utility_calls,
    )
    if exact:
        return _Estimate(
            scores=tuple(_shapley(game, n)),  # every coalition is cached: no evaluation
            permutations=len(marginals),
            note=f"every coalition evaluated after {len(marginals)} permutations: exact values",
        )
    estimate = torch.tensor(marginals, dtype=torch.float64).mean(dim=0)  # (n,)
    return _Estimate(
        scores=tuple(float(x) for x in estimate),
        permutations=len(marginals),
        converged=converged,
        note=""
        if converged
        else f"stopped after max_permutations={options.max_permutations} "
        f"before the estimate settled within {options.tolerance:g}",
    )


def exact_shapley(
    updates: Updates,
    *,
    utility: Utility,
    aggregate_fn: AggregateFn | None = None,
    baseline: float | None = None,
    max_players: int = 12,
) -> Quality:
    """Exact Shapley values of the `(n, d)` updates by enumerating every coalition.

    phi_i = sum over S in N \\ {i} of |S|! (n - |S| - 1)! / n! * (v(S + {i}) - v(S)), with
    v(C) = U(agg(updates[C])) and v(empty) = U(0). Refuses n > `max_players` (the cost
    doubles with every update); use `gtg_shapley` there.

    Cost: 2^n utility evaluations (2^n - 1 with `baseline`) and 2^n - 1 aggregations.
    """
    n, _ = check_updates(updates, "exact_shapley")
    if n > max_players:
        raise ValueError(
            f"exact_shapley: {n} updates need 2^{n} utility evaluations, over the limit of "
            f"{max_players} updates; use method='gtg_shapley' or raise max_players"
        )
    game = Game(
        updates,
        utility=utility,
        aggregate_fn=require_aggregate_fn(aggregate_fn, "exact_shapley"),
        method="exact_shapley",
        hint=_HINT,
        baseline=baseline,
    )
    phi = _shapley(game, n)
    return Quality(
        method="exact_shapley",
        scores=tuple(phi),
        baseline=game.baseline(),
        aggregate_utility=game.value(frozenset(range(n))),
        utility_calls=game.utility_calls,
        aggregations=game.aggregations,
    )


def _shapley(game: Game, n: int) -> list[float]:
    """Exact Shapley values `(n,)` of `game` by enumerating its 2^n coalitions (cached)."""
    weight = [math.factorial(s) * math.factorial(n - s - 1) / math.factorial(n) for s in range(n)]
    phi = [0.0] * n
    for mask in range(1 << n):
        coalition = frozenset(i for i in range(n) if mask >> i & 1)
        v = game.value(coalition)
        for i in range(n):
            if i not in coalition:
                phi[i] += weight[len(coalition)] * (game.value(coalition | {i}) - v)
    return phi


def _guided_permutation(n: int, first: int, generator: torch.Generator) -> list[int]:
    """`first`, then the other n - 1 indices in a random order."""
    others = [i for i in range(n) if i != first]
    return [first, *(others[int(j)] for j in torch.randperm(n - 1, generator=generator))]


def _walk(
    game: Game, order: list[int], v0: float, v_all: float, within_round_tol: float
) -> list[float]:
    """Marginal contribution `(n,)` of each update when they join in `order`, truncated once
    the prefix's utility is within `within_round_tol` of v(N)."""
    marginal = [0.0] * len(order)
    prefix: frozenset[int] = frozenset()
    previous = v0
    for player in order:
        prefix = prefix | {player}
        current = game.value(prefix) if abs(v_all - previous) >= within_round_tol else previous
        marginal[player] = current - previous
        previous = current
    return marginal


def _converged(marginals: list[list[float]], window: int, tolerance: float) -> bool:
    """Whether the last `window` running means lie within `tolerance` of the newest (relative L1)."""
    if len(marginals) < window:
        return False
    m = torch.tensor(marginals, dtype=torch.float64)  # (P, n)
    counts = torch.arange(1, m.shape[0] + 1, dtype=torch.float64)[:, None]  # (P, 1)
    running = (m.cumsum(dim=0) / counts)[-window:]  # (window, n)
    newest = running[-1]  # (n,)
    error = (running - newest).abs().sum(dim=1) / (newest.abs().sum() + 1e-12)  # (window,)
    return bool(error.max() < tolerance)
