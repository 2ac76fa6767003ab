"""`aggregate()` passes every rule parameter through and rejects unknown ones in one line."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from zoo_gym.aggregation import (
    PARAMS,
    RULES,
    aggregate,
    centered_clipping,
    geometric_median,
    krum,
    min_clients,
)


def test_every_rule_lists_its_parameters() -> None:
    expected = {
        "fedavg": frozenset(),
        "krum": frozenset({"m"}),
        "multikrum": frozenset({"m"}),
        "bulyan": frozenset(),
        "trimmed_mean": frozenset(),
        "median": frozenset(),
        "geometric_median": frozenset({"iters", "eps", "tol"}),
        "centered_clipping": frozenset({"tau", "iters", "center"}),
    }
    assert expected == PARAMS
    assert set(PARAMS) == set(RULES)


@pytest.mark.parametrize(
    ("rule", "params", "direct"),
    [
        ("krum", {"m": 2}, lambda x: krum(x, f=1, m=2)),
        ("multikrum", {"m": 3}, lambda x: krum(x, f=1, m=3)),
        (
            "geometric_median",
            {"iters": 7, "eps": 1e-6, "tol": 0.0},
            lambda x: geometric_median(x, iters=7, eps=1e-6, tol=0.0),
        ),
        (
            "centered_clipping",
            {"tau": 0.7, "iters": 2, "center": torch.ones(4)},
            lambda x: centered_clipping(x, tau=0.7, iters=2, center=torch.ones(4)),
        ),
        ("centered_clipping", {"iters": 3}, lambda x: centered_clipping(x, iters=3)),
    ],
)
def test_parameters_reach_the_rule(rule: str, params: dict[str, Any], direct: Any) -> None:
    x = torch.randn(7, 4, generator=torch.Generator().manual_seed(0))
    assert torch.equal(aggregate(rule, x, f=1, **params).vector, direct(x).vector)


@pytest.mark.parametrize("rule", sorted(RULES))
def test_unknown_parameter_is_one_clear_line(rule: str) -> None:
    x = torch.zeros(min_clients(rule, 1), 3)
    with pytest.raises(ValueError) as error:
        aggregate(rule, x, f=1, bogus=1)
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith(f"{rule} does not take parameter(s) 'bogus'; its parameters: ")
    assert message.endswith(", ".join(sorted(PARAMS[rule])) or "none")


def test_unknown_parameter_is_reported_before_anything_runs() -> None:
    with pytest.raises(ValueError, match=r"median does not take parameter\(s\) 'tau'"):
        aggregate("median", torch.zeros(1, 1), f=3, tau=1.0)  # too few updates, too


def test_whole_float_counts_from_a_config_are_accepted() -> None:
    x = torch.randn(7, 4, generator=torch.Generator().manual_seed(1))
    assert torch.equal(aggregate("multikrum", x, f=1, m=3.0).vector, krum(x, f=1, m=3).vector)
    a = aggregate("centered_clipping", x, iters=2.0)
    assert torch.equal(a.vector, centered_clipping(x, iters=2).vector)


def test_centered_clipping_needs_no_tau() -> None:
    result = aggregate("centered_clipping", torch.zeros(3, 2), f=1)
    assert result.vector.tolist() == [0.0, 0.0]
