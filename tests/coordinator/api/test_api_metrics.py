"""/metrics exposes the coordinator's metrics from its own registry."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import pytest

from zoo_gym import ledger
from zoo_gym.coordinator.metrics import REJECT_REASONS, CoordinatorMetrics, reason_label

if TYPE_CHECKING:
    from api_world import World


def value(text: str, sample: str) -> float:
    match = re.search(rf"^{re.escape(sample)} (\S+)$", text, re.MULTILINE)
    assert match is not None, f"{sample} missing from:\n{text}"
    return float(match.group(1))


def test_metrics_expose_rounds_submissions_aggregation_and_ledger(world: World) -> None:
    # Prepare
    m = world.metrics
    m.round_opened(3)
    m.observe_submission(accepted=True)
    m.observe_submission(accepted=True)
    m.observe_submission(
        accepted=False, reason="submission is for round 2 but round 3 is open (stale round); ..."
    )
    m.observe_submission(accepted=False, reason="update envelope is invalid: truncated")
    m.observe_aggregation(0.25)
    m.observe_round(3, 12.5, status="published")
    world.control.pause(by="test")

    # Execute
    response = world.client.get("/metrics", headers=world.as_viewer)

    # Assert
    text = response.text
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    assert value(text, "zoo_gym_round") == 3
    assert value(text, "zoo_gym_submissions_received_total") == 4
    assert value(text, "zoo_gym_submissions_accepted_total") == 2
    assert value(text, 'zoo_gym_submissions_rejected_total{reason="stale_round"}') == 1
    assert value(text, 'zoo_gym_submissions_rejected_total{reason="envelope"}') == 1
    assert value(text, "zoo_gym_aggregation_seconds_count") == 1
    assert value(text, "zoo_gym_aggregation_seconds_sum") == 0.25
    assert value(text, 'zoo_gym_rounds_total{status="published"}') == 1
    assert value(text, "zoo_gym_round_seconds_sum") == 12.5
    with world.session() as s:
        size = ledger.log_size(s)
    assert value(text, "zoo_gym_ledger_entries") == size
    assert value(text, "zoo_gym_ledger_rounds") == 1
    assert value(text, 'zoo_gym_contributors{status="active"}') == 2
    assert value(text, "zoo_gym_rounds_paused") == 1


def test_registries_are_per_coordinator() -> None:
    a, b = CoordinatorMetrics(), CoordinatorMetrics()
    a.observe_submission(accepted=True)
    assert b"zoo_gym_submissions_received_total 1.0" in a.exposition()
    assert b"zoo_gym_submissions_received_total 0.0" in b.exposition()


@pytest.mark.parametrize(
    ("reason", "label"),
    [
        ("submission signature does not match your key; it was altered", "signature"),
        (
            "update was trained on v0001 but round 3 builds on v0002 (stale base); fetch",
            "stale_base",
        ),
        ("update of 99999999 bytes exceeds the 1024-byte limit", "too_large"),
        ("payload size or SHA-256 differs from the signed statement", "digest"),
        ("you already have an accepted submission for round 4; only one counts", "duplicate"),
        ("round 5 closed for submissions at its deadline", "deadline"),
        ("contributor is banned", "banned"),
        ("update contains NaN or Inf values", "non_finite"),
        ("update is encoded with int8 but round 2 asks for bitdelta; compress it ...", "codec"),
        ("update L2 norm 9.05e+05 exceeds round 2's norm bound 1e+04; clip ...", "norm"),
        ("stale_round", "stale_round"),
        ("something new", "other"),
    ],
)
def test_reason_labels_stay_few(reason: str, label: str) -> None:
    assert reason_label(reason) == label in REJECT_REASONS
