import math
import subprocess
import sys

import pytest
from opacus.accountants import PRVAccountant, RDPAccountant

from zoo_gym.privacy.accounting import (
    epsilon,
    epsilon_of_history,
    gaussian_update_mechanism,
    noise_for_epsilon,
)


@pytest.mark.parametrize("name", ["rdp", "prv"])
def test_epsilon_equals_opacus(name: str) -> None:
    reference = RDPAccountant() if name == "rdp" else PRVAccountant()
    for _ in range(200):
        reference.step(noise_multiplier=1.1, sample_rate=0.02)

    assert epsilon(1.1, 0.02, 200, 1e-5, accountant=name) == pytest.approx(  # type: ignore[arg-type]
        reference.get_epsilon(delta=1e-5), rel=1e-6
    )


def test_known_rdp_value() -> None:
    # sigma 1.0, q 0.01, 1000 steps, delta 1e-5 under Opacus's RDP accountant.
    assert epsilon(1.0, 0.01, 1000, 1e-5) == pytest.approx(2.1014, abs=1e-3)


@pytest.mark.parametrize("name", ["rdp", "prv"])
def test_noise_for_epsilon_reaches_the_target(name: str) -> None:
    sigma = noise_for_epsilon(3.0, 0.01, 1000, 1e-5, accountant=name)  # type: ignore[arg-type]

    assert 0.5 < sigma < 2.0
    assert epsilon(sigma, 0.01, 1000, 1e-5, accountant=name) <= 3.0  # type: ignore[arg-type]
    assert epsilon(sigma * 0.9, 0.01, 1000, 1e-5, accountant=name) > 3.0  # type: ignore[arg-type]


def test_unknown_accountant() -> None:
    with pytest.raises(ValueError, match="unknown accountant"):
        epsilon(1.0, 0.01, 10, 1e-5, accountant="gdp")  # type: ignore[arg-type]


def test_privacy_imports_nothing_forbidden() -> None:
    code = (
        "import sys, zoo_gym.privacy.clip, zoo_gym.privacy.noise, zoo_gym.privacy.accounting;"
        "bad = {'grpc', 'flwr', 'sqlmodel', 'sqlalchemy', 'fastapi', 'typer', 'httpx'};"
        "print(sorted({m.split('.')[0] for m in sys.modules} & bad))"
    )

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)

    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("name", ["rdp", "prv"])
def test_history_composes_like_one_accountant_stepped_through_it(name: str) -> None:
    history = [(1.0, 0.05, 40), (2.0, 0.2, 10), (0.8, 0.01, 100)]
    reference = RDPAccountant() if name == "rdp" else PRVAccountant()
    for sigma, q, steps in history:
        for _ in range(steps):
            reference.step(noise_multiplier=sigma, sample_rate=q)

    composed = epsilon_of_history(history, 1e-5, accountant=name)  # type: ignore[arg-type]

    assert composed == pytest.approx(reference.get_epsilon(delta=1e-5), rel=1e-6)
    parts = math.fsum(epsilon(s, q, t, 1e-5, accountant=name) for s, q, t in history)  # type: ignore[arg-type]
    assert composed < parts  # composition beats the sum of the parts


def test_empty_history_spent_nothing_and_no_noise_is_unbounded() -> None:
    assert epsilon_of_history([], 1e-5) == 0.0
    assert epsilon_of_history([(1.0, 0.1, 0)], 1e-5) == 0.0
    assert epsilon_of_history([(1.0, 0.1, 5), (0.0, 1.0, 1)], 1e-5) == math.inf
    with pytest.raises(ValueError, match="delta"):
        epsilon_of_history([(1.0, 0.1, 5)], 0.0)


def test_gaussian_update_mechanism() -> None:
    # replace-one: sensitivity 2C, noise z*C -> sigma z/2; add/remove: sensitivity C -> sigma z
    assert gaussian_update_mechanism(3.0) == (1.5, 1.0, 1)
    assert gaussian_update_mechanism(3.0, replace_one=False) == (3.0, 1.0, 1)
    # the plain Gaussian mechanism at sigma 1.5: Opacus's RDP curve alpha / (2 sigma^2), converted
    reference = RDPAccountant()
    reference.step(noise_multiplier=1.5, sample_rate=1.0)
    assert epsilon_of_history([gaussian_update_mechanism(3.0)], 1e-5) == pytest.approx(
        reference.get_epsilon(delta=1e-5)
    )
    prv = epsilon_of_history([gaussian_update_mechanism(3.0)], 1e-5, accountant="prv")
    assert math.isfinite(prv) and 0 < prv < epsilon_of_history(
        [gaussian_update_mechanism(3.0)], 1e-5
    )


def test_a_long_history_of_repeated_mechanisms_matches_opacus() -> None:
    # a contributor's rounds: the same two mechanisms again and again (each RDP curve computed once)
    history = [(1.1, 0.05, 40), (0.9, 0.1, 20)] * 50
    direct = RDPAccountant()
    direct.history = list(history)

    assert epsilon_of_history(history, 1e-6) == pytest.approx(
        direct.get_epsilon(delta=1e-6), rel=1e-12
    )
