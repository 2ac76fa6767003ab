"""Privacy accounting with Opacus's accountants.

RDP: Rényi DP of the subsampled Gaussian mechanism [Mironov, 2017; Mironov et
al., 2019]. PRV: numerical composition of privacy random variables [Gopi et al.,
2021]. Both take the noise multiplier sigma (noise std / sensitivity), the
sampling rate q, the number of steps and the target delta.

A *history* is a list of mechanisms ``(sigma, q, steps)`` run one after the
other, in Opacus's own ``accountant.history`` format; its epsilon is the
accountant's composition of all of them (never the sum of per-entry epsilons,
which is a loose upper bound). The plain Gaussian mechanism is the entry
``(sigma, 1.0, 1)``.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Sequence
from typing import Literal

import numpy as np
from opacus.accountants import PRVAccountant, RDPAccountant
from opacus.accountants.accountant import IAccountant
from opacus.accountants.analysis import rdp as rdp_analysis
from opacus.accountants.utils import get_noise_multiplier

Accountant = Literal["rdp", "prv"]
Mechanism = tuple[float, float, int]  # (noise multiplier sigma, sample rate q, steps)
ACCOUNTANTS: tuple[Accountant, ...] = ("rdp", "prv")


RDP_ORDERS = tuple(RDPAccountant.DEFAULT_ALPHAS)


@functools.lru_cache(maxsize=4096)
def _rdp_curve(sigma: float, q: float) -> np.ndarray:
    """RDP of one subsampled Gaussian step at every order of RDP_ORDERS (read-only)."""
    curve = np.asarray(
        rdp_analysis.compute_rdp(q=q, noise_multiplier=sigma, steps=1, orders=RDP_ORDERS)
    )
    curve.setflags(write=False)
    return curve


def _accountant(name: str) -> IAccountant:
    if name == "rdp":
        return RDPAccountant()
    if name == "prv":
        return PRVAccountant()
    raise ValueError(f"unknown accountant {name!r}; choose 'rdp' or 'prv'")


def epsilon(
    noise_multiplier: float,
    sample_rate: float,
    steps: int,
    delta: float,
    accountant: Accountant = "rdp",
) -> float:
    """Epsilon after `steps` subsampled Gaussian steps at (sigma, q), for the given delta."""
    return epsilon_of_history([(noise_multiplier, sample_rate, steps)], delta, accountant)


def epsilon_of_history(
    history: Sequence[Mechanism], delta: float, accountant: Accountant = "rdp"
) -> float:
    """Epsilon of the composition of every mechanism in `history`, for the given delta.

    An empty history spent nothing (0.0); an entry with sigma <= 0 is not private
    (``inf``). Entries with zero steps or zero sample rate are skipped.
    """
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    entries = [(float(s), float(q), int(t)) for s, q, t in history if t > 0 and q > 0]
    for sigma, q, _ in entries:
        if not 0 < q <= 1:
            raise ValueError(f"sample rate must be in (0, 1], got {q}")
        if not sigma > 0:
            return math.inf
    if not entries:
        return 0.0
    # PRV at q = 1 takes log(0) on a branch np.where discards; the result is finite. RDP warns
    # when the best order is its largest one: the bound is then looser, still valid.
    with warnings.catch_warnings(), np.errstate(divide="ignore", invalid="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)
        warnings.filterwarnings("ignore", message="Optimal order is the largest alpha")
        if accountant == "rdp":
            # what RDPAccountant.get_epsilon computes, with the RDP curve of each (sigma, q)
            # computed once: a contributor's many rounds usually repeat a few mechanisms
            curve = sum(t * _rdp_curve(sigma, q) for sigma, q, t in entries)
            eps, _ = rdp_analysis.get_privacy_spent(orders=RDP_ORDERS, rdp=curve, delta=delta)
            return float(eps)
        acc = _accountant(accountant)
        acc.history = entries
        return float(acc.get_epsilon(delta=delta))


def noise_for_epsilon(
    target_epsilon: float,
    sample_rate: float,
    steps: int,
    delta: float,
    accountant: Accountant = "rdp",
) -> float:
    """Smallest noise multiplier (to Opacus's tolerance of 0.01 in epsilon) with
    ``epsilon(sigma, q, steps, delta) <= target_epsilon``.

    Raises ValueError when no sigma below Opacus's limit (1e6) reaches the target.
    """
    _accountant(accountant)
    if not target_epsilon > 0:
        raise ValueError(f"target epsilon must be > 0, got {target_epsilon}")
    with warnings.catch_warnings(), np.errstate(divide="ignore", invalid="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)
        warnings.filterwarnings("ignore", message="Optimal order is the largest alpha")
        return float(
            get_noise_multiplier(
                target_epsilon=target_epsilon,
                target_delta=delta,
                sample_rate=sample_rate,
                steps=steps,
                accountant=accountant,
            )
        )


def gaussian_update_mechanism(noise_multiplier: float, *, replace_one: bool = True) -> Mechanism:
    """The Gaussian mechanism on an update clipped to norm C with noise std ``z * C``, as a history entry.

    Under add/remove adjacency (one contributor's update present or replaced by zero)
    the L2 sensitivity is C and the entry is ``(z, 1, 1)``. Under replace-one adjacency
    (any two datasets of the same contributor, the local-DP notion: the two clipped
    updates may point in opposite directions) the sensitivity is 2C, so the effective
    noise multiplier is ``z / 2`` [Dwork & Roth, 2014, Thm. A.1; McMahan et al., 2018].
    """
    return (noise_multiplier / 2.0 if replace_one else noise_multiplier, 1.0, 1)


__all__ = [
    "ACCOUNTANTS",
    "Accountant",
    "Mechanism",
    "epsilon",
    "epsilon_of_history",
    "gaussian_update_mechanism",
    "noise_for_epsilon",
]
