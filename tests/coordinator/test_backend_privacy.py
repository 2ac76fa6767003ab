"""What intake reads from a submission's privacy metrics: the DP-SGD mechanism it states."""

from __future__ import annotations

import math

import pytest
from flwr.app import MetricRecord, RecordDict

from zoo_gym.coordinator.privacy_claims import claimed_epsilon, stated_mechanism
from zoo_gym.core.protocol import TRAIN_METRICS
from zoo_gym.ledger import DpMechanism

STATED = {
    "dp_noise_multiplier": 1.25,
    "dp_sample_rate": 0.04,
    "dp_steps": 30.0,
    "dp_delta": 1e-5,
    "dp_accountant_prv": 0.0,
    "epsilon": 2.5,
}


def content(**metrics: float) -> RecordDict:
    return RecordDict({TRAIN_METRICS: MetricRecord(dict(metrics))})


def test_a_stated_mechanism_is_read_whole() -> None:
    assert stated_mechanism(content(**STATED)) == DpMechanism(1.25, 0.04, 30, 1e-5, "rdp")
    prv = stated_mechanism(content(**(STATED | {"dp_accountant_prv": 1.0})))
    assert prv is not None and prv.accountant == "prv"
    assert claimed_epsilon(content(**STATED)) == 2.5


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("dp_noise_multiplier", 0.0),  # not a private round (what a client without DP sends)
        ("dp_noise_multiplier", -1.0),
        ("dp_sample_rate", 0.0),
        ("dp_sample_rate", 1.5),
        ("dp_steps", 0.0),
        ("dp_steps", 2.5),
        ("dp_steps", 1e12),
        ("dp_delta", 0.0),
        ("dp_delta", 1.0),
        ("dp_delta", math.nan),
        ("dp_sample_rate", math.inf),
    ],
)
def test_values_that_describe_no_mechanism_are_not_recorded(key: str, value: float) -> None:
    assert stated_mechanism(content(**(STATED | {key: value}))) is None


def test_no_metrics_no_mechanism() -> None:
    assert stated_mechanism(RecordDict()) is None
    missing = {k: v for k, v in STATED.items() if k != "dp_delta"}
    assert stated_mechanism(content(**missing)) is None
