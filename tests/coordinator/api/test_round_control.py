"""RoundControl: the requests the round loop consults between and during rounds."""

from __future__ import annotations

import threading

from zoo_gym.coordinator.config import CoordinatorConfig
from zoo_gym.coordinator.control import PolicyChange, RoundControl, merge_policy


def test_not_paused_runs_and_a_stop_ends_a_pause() -> None:
    control, stop = RoundControl(), threading.Event()
    assert control.wait_until_runnable(stop)
    control.pause(by="op")
    stop.set()
    assert not control.wait_until_runnable(stop, poll_s=0.01)


def test_resume_wakes_a_waiting_loop() -> None:
    control, stop = RoundControl(), threading.Event()
    control.pause(by="op", reason="upgrade")
    result: list[bool] = []
    waiter = threading.Thread(target=lambda: result.append(control.wait_until_runnable(stop)))
    waiter.start()
    waiter.join(0.1)
    assert waiter.is_alive()
    assert control.resume(by="op") and not control.resume(by="op")
    waiter.join(5)
    assert result == [True]


def test_start_request_is_spent_once() -> None:
    control, stop = RoundControl(), threading.Event()
    control.pause(by="op")
    control.request_start(by="op")
    assert control.wait_until_runnable(stop, poll_s=0.01)
    assert control.state().start is None and control.paused
    stop.set()
    assert not control.wait_until_runnable(stop, poll_s=0.01)


def test_abort_request_lives_until_its_round_finishes() -> None:
    control = RoundControl()
    control.request_abort(4, by="op", reason="poisoned")
    control.round_started(4)
    request = control.abort_requested(4)
    assert request is not None and (request.by, request.reason) == ("op", "poisoned")
    assert control.abort_requested(5) is None
    control.round_finished(4)
    assert control.abort_requested(4) is None and control.state().current_round is None


def test_policy_is_taken_once() -> None:
    control = RoundControl()
    config, changes = merge_policy(CoordinatorConfig(), {"aggregator": "trimmed_mean"})
    control.stage_policy(PolicyChange(config, changes, by="op"))
    assert control.state().policy is not None
    change = control.take_policy()
    assert change is not None and change.changes == {"aggregator": ("median", "trimmed_mean")}
    assert control.take_policy() is None and control.pending_policy() is None
