"""Intake checks submissions side by side: the slow part of one (reading, hashing and scanning
its envelope) does not hold back another's decision. Real backend behind real gRPC."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from wire import build_wire, config_of, take_task

from zoo_gym.client.runtime import signed_reply
from zoo_gym.coordinator import intake as intake_module
from zoo_gym.core.identity import Identity
from zoo_gym.transport.client import SubmitResult


def test_one_slow_envelope_check_does_not_hold_back_another_submission(
    tiny_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: two contributors holding their tasks of round 1; the first envelope scanned
    # waits until the test lets it go on
    wire = build_wire(tiny_home)
    try:
        alice, bob = Identity.generate(), Identity.generate()
        clients = {who: wire.client(who) for who in (alice, bob)}
        for who, client in clients.items():
            client.register(who.contributor_id[:8])
        wire.open_round(1, [alice, bob])
        tasks = {who: take_task(client) for who, client in clients.items()}
        scanning, go_on = threading.Event(), threading.Event()
        real = intake_module.envelope_reason

        def held(data: bytes, current: intake_module.OpenRound) -> str:
            if not scanning.is_set():
                scanning.set()
                go_on.wait(20)
            return real(data, current)

        monkeypatch.setattr(intake_module, "envelope_reason", held)

        def submit(who: Identity) -> SubmitResult:
            task = tasks[who]
            reply = signed_reply(who, task.message, config_of(task), wire.payload(task), {})
            return clients[who].submit(task, reply)

        # Execute: alice's envelope is being scanned while bob submits
        first: list[SubmitResult] = []
        alice_sends = threading.Thread(target=lambda: first.append(submit(alice)))
        alice_sends.start()
        assert scanning.wait(20)
        second = submit(bob)
        bob_done_while_alice_held = not go_on.is_set() and not first
        go_on.set()
        alice_sends.join(timeout=20)

        # Assert: bob's decision came while alice's check was still held; both were accepted
        assert bob_done_while_alice_held
        assert second.accepted and first and first[0].accepted
        assert [r[1] for r in wire.rows(alice)] == [r[1] for r in wire.rows(bob)] == ["accepted"]
    finally:
        wire.close()
