"""Phases report their own wall time and peak RSS, nested phases included."""

from __future__ import annotations

import logging
import re
import sys

import pytest
import torch

from zoo_gym.core.phases import CLOCK, MIB, phase

LINE = re.compile(r"phase (\S+): ([\d.]+) s, peak RSS (\d+) MiB(?: \((.*)\))?")

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the peak is reset on Linux only")


def touched(mib: int) -> torch.Tensor:
    """`mib` MiB resident (every page written)."""
    return torch.ones(mib * MIB // 4, dtype=torch.float32)


def peaks(caplog: pytest.LogCaptureFixture) -> dict[str, int]:
    found = {}
    for record in caplog.records:
        match = LINE.fullmatch(record.getMessage())
        assert match, record.getMessage()
        found[match.group(1)] = int(match.group(3))
    return found


def test_each_phase_reports_its_own_peak_and_the_outer_one_covers_the_inner(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Prepare
    caplog.set_level(logging.INFO, logger="zoo_gym.core.phases")
    before = CLOCK.peak_bytes()

    # Execute: 256 MiB held inside `inner` only; `after` runs once it is freed
    with phase("outer"):
        with phase("inner", "256 MiB"):
            held = touched(256)
            del held
        small = touched(8)
    with phase("after"):
        small += 1

    # Assert
    got = peaks(caplog)
    assert CLOCK.resettable
    current = before // MIB
    assert got["inner"] >= 256 and got["outer"] >= got["inner"]
    assert got["after"] < got["inner"] - 200  # the 256 MiB are not counted again
    assert got["after"] <= current + 64
    assert "(256 MiB)" in caplog.records[0].getMessage()


def test_a_phase_that_raises_is_still_reported(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="zoo_gym.core.phases")
    with pytest.raises(ValueError), phase("failing"):
        raise ValueError("x")
    assert list(peaks(caplog)) == ["failing"]
    assert not CLOCK.stack
