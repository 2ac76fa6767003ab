"""Stopping `gym-coordinator serve`, and what `/health` says about its round loop, with real
processes on 127.0.0.1 and the default limits and timeouts unless a test names one.

- SIGTERM with a round open (round_timeout_s = 600), one contributor holding its task and one
  mid-upload: serve exits 0 well within 30 s, the round is recorded aborted with its reason,
  the log is signed up to its last entry and the half upload is gone from the spool;
- a second SIGTERM while the first is being handled ends serve at once (slow-marked);
- a `spool/*.part` left by an earlier process is removed at start; with rounds = 0 and nobody
  connecting the loop waits again and again, `/health` stays ok, and SIGINT stops it while
  it waits;
- with rounds = N and nobody connecting the loop ends: `serve --stay` answers `/health` with a
  503 and the reason, plain `serve` exits 1 with one line (slow-marked: one more start).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import httpx
import pytest
import torch
from flwr.app import Message
from serve_process import ServeProcess, serve, stop, write_settings
from sqlmodel import Session

from zoo_gym import ledger
from zoo_gym.client.runtime import signed_reply
from zoo_gym.compression import CodecSpec, encode
from zoo_gym.coordinator.config import load_config
from zoo_gym.coordinator.serve import STOP_WITHIN_S
from zoo_gym.core.identity import Identity
from zoo_gym.core.lora import LoraSpec, update_shapes
from zoo_gym.core.protocol import TASK_CONFIG, TaskConfig
from zoo_gym.proto.v1 import federation_pb2 as pb
from zoo_gym.simulation.demo import free_port
from zoo_gym.transport.client import FederationClient, ReceivedTask
from zoo_gym.transport.records import header_of, unpack_reply
from zoo_gym.transport.server import serialize_message

pytestmark = pytest.mark.e2e


def wait_for(check: Callable[[], object], what: str, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.2)


def take_task(client: FederationClient, timeout_s: float = 90) -> ReceivedTask:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        task = client.poll(2.0)
        if task is not None:
            return task
    pytest.fail("no task was handed out")


def terminate(
    served: ServeProcess, sig: int = signal.SIGTERM, *, again_after_s: float | None = None
) -> tuple[int, float]:
    """Signal `served` (`sig` once more after `again_after_s`); its exit status and how many
    seconds it took to exit."""
    began = time.monotonic()
    served.proc.send_signal(sig)
    if again_after_s is not None:
        time.sleep(again_after_s)
        served.proc.send_signal(sig)
    try:
        code = served.proc.wait(timeout=STOP_WITHIN_S + 30)
    except subprocess.TimeoutExpired:
        pytest.fail(f"serve did not exit after {signal.Signals(sig).name}:\n{served.log[-3000:]}")
    return code, time.monotonic() - began


def zero_update(home: Path, config: TaskConfig) -> bytes:
    from zoo_gym.core.weights import load_weights

    state = load_weights(home / "models" / "v0000")
    spec = LoraSpec(config.lora_rank, config.lora_alpha, tuple(config.target_modules))
    shapes = update_shapes(state, adapter="ffa_lora", spec=spec)
    return encode({k: torch.zeros(s) for k, s in shapes.items()}, CodecSpec(config.codec, 128))


def stalled_upload(
    client: FederationClient, me: Identity, task: ReceivedTask, home: Path, hold: threading.Event
) -> grpc.Future:
    """Start `task`'s signed submission, send the header and a few bytes, then hold the stream."""
    config = TaskConfig.from_record(task.message.content.config_records[TASK_CONFIG])
    reply = signed_reply(me, task.message, config, zero_update(home, config), {"num_examples": 1})
    sub, payload, rest = unpack_reply(reply)
    header = header_of(
        sub,
        client._auth("submit", f"{sub.message_id}|{sub.payload_sha256}"),
        serialize_message(Message(rest, reply_to=task.message)),
    )

    def chunks() -> Iterator[pb.UpdateChunk]:
        yield pb.UpdateChunk(header=header)
        yield pb.UpdateChunk(data=payload[:16])
        hold.wait(120)

    future: grpc.Future = client.stub.SubmitUpdate.future(chunks(), timeout=120)
    return future


def round_row(home: Path, number: int) -> tuple[str, dict[str, object]]:
    engine = ledger.open_database(load_config(home / "coordinator.toml").ledger_url)
    try:
        with Session(engine) as session:
            [found] = [r for r in ledger.list_rounds(session) if r.number == number]
            return found.status, dict(found.metrics)
    finally:
        engine.dispose()


def log_and_checkpoint_sizes(home: Path) -> tuple[int, int]:
    engine = ledger.open_database(load_config(home / "coordinator.toml").ledger_url)
    try:
        with Session(engine) as session:
            stats = ledger.ledger_stats(session)
            return stats.entries, stats.checkpoint_size
    finally:
        engine.dispose()


@contextmanager
def round_one_held(served: ServeProcess) -> Iterator[grpc.Future]:
    """Two contributors in round 1: a holds its task, b is uploading its update and holds the
    stream after a few bytes. Yields b's upload."""
    hold = threading.Event()
    a_id, b_id = Identity.generate(), Identity.generate()
    a = FederationClient(served.address, a_id, timeout_s=10)
    b = FederationClient(served.address, b_id, timeout_s=10)
    try:
        a.register("a")
        b.register("b")
        tasks: dict[str, ReceivedTask] = {}
        taking = threading.Thread(target=lambda: tasks.update(a=take_task(a)))
        taking.start()
        task_b = take_task(b)
        taking.join(timeout=100)
        assert "a" in tasks and tasks["a"].round == task_b.round == 1
        upload = stalled_upload(b, b_id, task_b, served.home, hold)
        wait_for(lambda: list((served.home / "spool").glob("*.part")), "b's upload to start")
        yield upload
    finally:
        hold.set()
        a.close()
        b.close()


def test_sigterm_with_a_round_open_stops_promptly_and_aborts_it(tiny_home: Path) -> None:
    # Prepare: default settings (min_clients = 2, round_timeout_s = 600); a holds its task, b is
    # uploading its update when the signal comes
    with serve(tiny_home) as coordinator, round_one_held(coordinator) as upload:
        health = httpx.get(f"{coordinator.rest}/health", timeout=5).json()
        assert health["open_round"] == 1 and health["round_loop"] == "running"

        # Execute
        code, took = terminate(coordinator)

    # Assert: exit 0 within the bound (not after round_timeout_s); round 1 aborted with the
    # reason; every log entry under a signed checkpoint; nothing half-written left behind
    assert code == 0, coordinator.log[-3000:]
    assert took < STOP_WITHIN_S, f"took {took:.1f} s"
    assert "stopping (SIGTERM)" in coordinator.log
    status, metrics = round_row(tiny_home, 1)
    assert status == "aborted"
    assert metrics["reason"] == "coordinator stopping" and metrics["aborted_by"] == "coordinator"
    entries, signed = log_and_checkpoint_sizes(tiny_home)
    assert signed == entries > 0
    assert not list((tiny_home / "spool").glob("*.part"))
    assert upload.exception(timeout=10) is not None  # the held upload was cut, not accepted


@pytest.mark.slow
def test_a_second_signal_stops_at_once(tiny_home: Path) -> None:
    # Prepare: a round open with an upload held, so the first stop takes gRPC's 1 s grace
    with serve(tiny_home) as coordinator, round_one_held(coordinator):
        # Execute
        code, took = terminate(coordinator, again_after_s=0.3)

    # Assert: ended by the second signal, not by the orderly stop
    assert code == 128 + signal.SIGTERM, coordinator.log[-3000:]
    assert took < STOP_WITHIN_S
    assert "second signal: stopping at once" in coordinator.log


def test_idle_loop_waits_again_spool_cleared_and_sigterm_while_waiting(tiny_home: Path) -> None:
    # Prepare: a half upload from an earlier process; rounds = 0 (the default), nobody connects
    spool = tiny_home / "spool"
    spool.mkdir()
    (spool / "tmp1234abcd.part").write_bytes(b"half an upload")

    with serve(tiny_home, wait_for_clients_s=1) as coordinator:
        assert not list(spool.glob("*.part"))
        wait_for(
            lambda: coordinator.log.count("waiting again") >= 3, "the loop to wait three times"
        )
        answer = httpx.get(f"{coordinator.rest}/health", timeout=5)

        # Execute: stop it (Ctrl-C) while it waits for contributors
        code, took = terminate(coordinator, signal.SIGINT)

    # Assert
    assert "removed 1 unfinished upload(s)" in coordinator.log
    assert "no contributors connected within 1 s (min_clients = 2); waiting again" in (
        coordinator.log
    )
    assert answer.status_code == 200
    body = answer.json()
    assert body["status"] == "ok" and body["round_loop"] == "waiting"
    assert body["paused"] is False and body["open_round"] is None
    assert code == 0 and took < STOP_WITHIN_S, coordinator.log[-3000:]
    assert "stopping (SIGINT)" in coordinator.log


def serve_argv(home: Path, *flags: str, **settings: object) -> tuple[list[str], str]:
    """`gym-coordinator serve` on `home` with `settings` on free loopback ports; its REST URL."""
    config = home / "coordinator.toml"
    rest = f"127.0.0.1:{free_port()}"
    write_settings(config, {"listen": f"127.0.0.1:{free_port()}", "rest_listen": rest, **settings})
    argv = [sys.executable, "-m", "zoo_gym.cli.coordinator", "serve", "-c", str(config), *flags]
    return argv, f"http://{rest}"


def test_loop_that_ran_out_of_contributors_answers_503(tiny_home: Path) -> None:
    # Prepare: rounds = 1 and nobody connects within a second; --stay keeps serve answering
    argv, rest = serve_argv(tiny_home, "--stay", rounds=1, wait_for_clients_s=1)
    log = (tiny_home / "serve.log").open("wb")
    proc = subprocess.Popen(
        argv,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        start_new_session=True,
    )
    served = ServeProcess("", rest, tiny_home, proc)
    answers: list[httpx.Response] = []

    def unhealthy() -> bool:
        assert proc.poll() is None, served.log[-3000:]
        try:
            answers.append(httpx.get(f"{rest}/health", timeout=2))
        except httpx.HTTPError:
            return False
        return answers[-1].status_code == 503

    try:
        # Execute
        wait_for(unhealthy, "/health to answer 503")
        code, _ = terminate(served)
    finally:
        stop(proc)
        log.close()

    # Assert: the reason says what happened; a signal still stops it with status 0
    body = answers[-1].json()
    assert body["status"] == "unavailable" and body["round_loop"] == "stopped"
    assert body["reason"].startswith("no contributors connected within 1 s (min_clients = 2)")
    assert "0 of 1 rounds ran" in body["reason"]
    assert code == 0, served.log[-3000:]


@pytest.mark.slow
def test_serve_without_stay_exits_1_when_no_round_ran(tiny_home: Path) -> None:
    argv, _ = serve_argv(tiny_home, rounds=1, wait_for_clients_s=1)

    ended = subprocess.run(argv, capture_output=True, text=True, timeout=180)

    assert ended.returncode == 1
    assert ended.stderr.splitlines()[-1].startswith(
        "error: no contributors connected within 1 s (min_clients = 2); 0 of 1 rounds ran"
    )
    assert "Traceback" not in ended.stderr
