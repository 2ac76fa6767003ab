"""One entry point for every rule: `aggregate(rule, updates, f=..., pre=..., **params)`.

`RULES` maps a rule name to its function with the uniform signature
`(updates, *, f, weights, **params) -> Aggregate`; `PARAMS` maps it to the keyword
parameters it accepts beyond f and weights; `min_clients(rule, f)` gives the number of
updates each rule needs to tolerate f Byzantine ones.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from torch import Tensor

from ._core import Aggregate, check_f, check_updates, require
from .bulyan import bulyan
from .centered_clipping import centered_clipping
from .columns import Updates
from .fedavg import fedavg
from .geometric_median import geometric_median
from .krum import krum
from .median import median
from .nnm import nnm
from .trimmed_mean import trimmed_mean

PRE_STEPS = ("nnm",)
#: rules that weight updates (e.g. by examples trained on); the others treat updates equally
WEIGHTED_RULES = frozenset({"fedavg", "geometric_median"})


def _no_weights(rule: str, weights: Tensor | None) -> None:
    if weights is not None:
        raise ValueError(
            f"{rule} does not take weights; use fedavg or geometric_median for weights"
        )


def _fedavg(updates: Updates, *, f: int, weights: Tensor | None, **params: Any) -> Aggregate:
    return fedavg(updates, weights=weights, **params)


def _krum(updates: Updates, *, f: int, weights: Tensor | None, **params: Any) -> Aggregate:
    _no_weights("krum", weights)
    return krum(updates, f=f, **params)


def _multikrum(
    updates: Updates, *, f: int, weights: Tensor | None, m: int | None = None, **params: Any
) -> Aggregate:
    _no_weights("multikrum", weights)
    n, _ = check_updates(updates, "multikrum")
    return krum(updates, f=f, m=n - f if m is None else m, **params)


def _bulyan(updates: Updates, *, f: int, weights: Tensor | None, **params: Any) -> Aggregate:
    _no_weights("bulyan", weights)
    return bulyan(updates, f=f, **params)


def _trimmed_mean(updates: Updates, *, f: int, weights: Tensor | None, **params: Any) -> Aggregate:
    _no_weights("trimmed_mean", weights)
    return trimmed_mean(updates, f=f, **params)


def _median(updates: Updates, *, f: int, weights: Tensor | None, **params: Any) -> Aggregate:
    _no_weights("median", weights)
    return median(updates, **params)


def _geometric_median(
    updates: Updates, *, f: int, weights: Tensor | None, **params: Any
) -> Aggregate:
    return geometric_median(updates, weights=weights, **params)


def _centered_clipping(
    updates: Updates, *, f: int, weights: Tensor | None, **params: Any
) -> Aggregate:
    _no_weights("centered_clipping", weights)
    return centered_clipping(updates, **params)


RULES: dict[str, Callable[..., Aggregate]] = {
    "fedavg": _fedavg,
    "krum": _krum,
    "multikrum": _multikrum,
    "bulyan": _bulyan,
    "trimmed_mean": _trimmed_mean,
    "median": _median,
    "geometric_median": _geometric_median,
    "centered_clipping": _centered_clipping,
}


def _keywords(fn: Callable[..., Any]) -> frozenset[str]:
    """Keyword-only parameters of a rule function, f and weights aside."""
    return frozenset(
        name
        for name, p in inspect.signature(fn).parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY and name not in ("f", "weights")
    )


#: the parameters each rule accepts through `aggregate(..., **params)`
PARAMS: dict[str, frozenset[str]] = {
    "fedavg": _keywords(fedavg),
    "krum": _keywords(krum),
    "multikrum": _keywords(krum),
    "bulyan": _keywords(bulyan),
    "trimmed_mean": _keywords(trimmed_mean),
    "median": _keywords(median),
    "geometric_median": _keywords(geometric_median),
    "centered_clipping": _keywords(centered_clipping),
}

_MIN_CLIENTS: dict[str, Callable[[int], int]] = {
    "fedavg": lambda f: 1,
    "krum": lambda f: 2 * f + 3,
    "multikrum": lambda f: 2 * f + 3,
    "bulyan": lambda f: 4 * f + 3,
    "trimmed_mean": lambda f: 2 * f + 1,
    "median": lambda f: 2 * f + 1,
    "geometric_median": lambda f: 2 * f + 1,
    "centered_clipping": lambda f: 2 * f + 1,
}


def min_clients(rule: str, f: int) -> int:
    """The fewest updates `rule` needs to tolerate f Byzantine ones.

    Krum and Multi-Krum: 2f + 3. Bulyan: 4f + 3. Trimmed mean, median, geometric median and
    centered clipping: 2f + 1 (an honest majority). FedAvg: 1 (it tolerates none).
    """
    check_f(f, "min_clients")
    if rule not in _MIN_CLIENTS:
        raise ValueError(f"unknown aggregation rule {rule!r}; choose one of {', '.join(RULES)}")
    return _MIN_CLIENTS[rule](f)


def check_params(rule: str, params: dict[str, Any]) -> None:
    """Raise one-line ValueError if `params` names a parameter `rule` does not accept."""
    if rule not in RULES:
        raise ValueError(f"unknown aggregation rule {rule!r}; choose one of {', '.join(RULES)}")
    unknown = sorted(set(params) - PARAMS[rule])
    if unknown:
        accepted = ", ".join(sorted(PARAMS[rule])) or "none"
        raise ValueError(
            f"{rule} does not take parameter(s) {', '.join(map(repr, unknown))}; "
            f"its parameters: {accepted}"
        )


def aggregate(
    rule: str,
    updates: Updates,
    *,
    f: int = 0,
    weights: Tensor | None = None,
    pre: str | None = None,
    **params: Any,
) -> Aggregate:
    """Aggregate the `(n, d)` updates (a tensor or a column source) with `rule`,
    tolerating f Byzantine updates.

    `pre="nnm"` first replaces each update by the mean of its n - f nearest neighbours
    (Allouah et al., 2023); decisions still refer to the original updates, by index.
    `params` go to the rule; `PARAMS[rule]` lists the names it accepts (`m` for Krum and
    Multi-Krum; `tau`, `iters`, `center` for centered clipping; `iters`, `eps`, `tol` for
    the geometric median). An unknown name is a ValueError naming the accepted ones.
    """
    check_params(rule, params)
    if pre is not None and pre not in PRE_STEPS:
        raise ValueError(
            f"unknown pre-aggregation step {pre!r}; choose one of {', '.join(PRE_STEPS)}"
        )
    n, _ = check_updates(updates, rule)
    require(n, min_clients(rule, f), f"{rule} with f={f}", "enough updates for f Byzantine ones")
    if weights is not None and rule not in WEIGHTED_RULES:
        _no_weights(rule, weights)
    if pre == "nnm":
        result = RULES[rule](nnm(updates, f=f), f=f, weights=weights, **params)
        decisions = tuple(
            replace(d, reason=f"{d.reason} (after nearest-neighbour mixing)")
            for d in result.decisions
        )
        return Aggregate(result.vector, decisions)
    return RULES[rule](updates, f=f, weights=weights, **params)
