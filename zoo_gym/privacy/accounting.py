"""Privacy accounting with Opacus's accountants.

RDP: Rényi DP of the subsampled Gaussian mechanism [Mironov, 2017; Mironov et
al., 2019]. PRV: numerical composition of privacy random variables [Gopi et al.,
2021]. Both take the noise multiplier sigma (noise std / clipping norm), the
sampling rate q, the number of steps and the target delta.
"""

from __future__ import annotations

from typing import Literal

from opacus.accountants import PRVAccountant, RDPAccountant
from opacus.accountants.accountant import IAccountant
from opacus.accountants.utils import get_noise_multiplier

Accountant = Literal["rdp", "prv"]


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
    acc = _accountant(accountant)
    acc.history = [(noise_multiplier, sample_rate, steps)]
    return float(acc.get_epsilon(delta=delta))


def noise_for_epsilon(
    target_epsilon: float,
    sample_rate: float,
    steps: int,
    delta: float,
    accountant: Accountant = "rdp",
) -> float:
    """Smallest noise multiplier (to Opacus's tolerance) reaching `target_epsilon`."""
    _accountant(accountant)
    return float(
        get_noise_multiplier(
            target_epsilon=target_epsilon,
            target_delta=delta,
            sample_rate=sample_rate,
            steps=steps,
            accountant=accountant,
        )
    )
