"""Bad input gets one clear line and the coordinator keeps serving.

A real coordinator process on 127.0.0.1; a contributor built from the real
transport client sends what a confused or malicious contributor would.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from zoo_gym.client.runtime import signed_reply
from zoo_gym.compression import CodecSpec, encode
from zoo_gym.core.identity import Identity
from zoo_gym.core.protocol import TASK_CONFIG, TaskConfig
from zoo_gym.simulation.demo import free_port
from zoo_gym.transport.client import FederationClient, ReceivedTask, TransportError

pytestmark = pytest.mark.e2e

CLI = [sys.executable, "-m"]


def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120, cwd=cwd)


def one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    return lines[0]


@pytest.fixture
def coordinator(tiny_home: Path) -> Iterator[tuple[str, str, Path]]:
    port, rest = free_port(), free_port()
    config = tiny_home / "coordinator.toml"
    text = re.sub(r"(?m)^(rest_)?listen = .*\n", "", config.read_text())
    config.write_text(
        text.replace(
            "[training]",
            (
                f'listen = "127.0.0.1:{port}"\nrest_listen = "127.0.0.1:{rest}"\nrounds = 4\nmin_clients = 1\n'
                "round_timeout_s = 120\nmax_upload_bytes = 65536\n\n[training]"
            ),
        )
    )
    log = (tiny_home / "serve.log").open("wb")
    proc = subprocess.Popen(
        [*CLI, "zoo_gym.cli.coordinator", "serve", "-c", str(config)],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{rest}"
    try:
        for _ in range(120):
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        else:
            pytest.fail((tiny_home / "serve.log").read_text())
        yield f"127.0.0.1:{port}", base, tiny_home
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def serving(address: str, rest: str) -> bool:
    probe = FederationClient(address, Identity.generate(), timeout_s=5)
    try:
        probe.register("probe")
    finally:
        probe.close()
    return httpx.get(f"{rest}/health", timeout=5).json()["status"] == "ok"


def zero_update(task: TaskConfig, home: Path) -> bytes:
    from zoo_gym.core.lora import LoraSpec, update_shapes
    from zoo_gym.core.weights import load_weights

    state = load_weights(home / "models" / "v0000")
    spec = LoraSpec(rank=task.lora_rank, alpha=task.lora_alpha, target_modules=task.target_modules)
    shapes = update_shapes(state, adapter="ffa_lora", spec=spec)
    delta = {key: torch.zeros(shape) for key, shape in shapes.items()}
    return encode(delta, CodecSpec(task.codec, task.group_size))


def test_dead_coordinator_address(tmp_path: Path) -> None:
    assert run_cli("zoo_gym.cli.client", "init", "--home", str(tmp_path / "c")).returncode == 0
    data = tmp_path / "data.jsonl"
    data.write_text('{"instruction": "a", "output": "b"}\n')
    result = run_cli(
        "zoo_gym.cli.client",
        "join",
        f"127.0.0.1:{free_port()}",
        "--home",
        str(tmp_path / "c"),
        "--data",
        str(data),
    )
    assert "cannot reach the coordinator" in one_error_line(result)


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("", "the file has no examples"),
        ("{not json\n", "invalid JSON"),
        ('{"question": 1}\n', "each line must be"),
    ],
)
def test_bad_data_file(tmp_path: Path, content: str, expected: str) -> None:
    assert run_cli("zoo_gym.cli.client", "init", "--home", str(tmp_path / "c")).returncode == 0
    data = tmp_path / "data.jsonl"
    data.write_text(content)
    result = run_cli(
        "zoo_gym.cli.client",
        "join",
        "127.0.0.1:1",
        "--home",
        str(tmp_path / "c"),
        "--data",
        str(data),
    )
    line = one_error_line(result)
    assert expected in line and str(data) in line


def test_missing_data_file(tmp_path: Path) -> None:
    assert run_cli("zoo_gym.cli.client", "init", "--home", str(tmp_path / "c")).returncode == 0
    result = run_cli(
        "zoo_gym.cli.client",
        "join",
        "127.0.0.1:1",
        "--home",
        str(tmp_path / "c"),
        "--data",
        str(tmp_path / "nope.jsonl"),
    )
    assert "no such data file" in one_error_line(result)


def test_wrong_config_value(tiny_home: Path) -> None:
    config = tiny_home / "coordinator.toml"
    config.write_text(
        config.read_text().replace("[training]", 'aggregator = "krumm"\n\n[training]')
    )
    line = one_error_line(run_cli("zoo_gym.cli.coordinator", "serve", "-c", str(config)))
    assert "aggregator" in line and "krumm" in line and "fedavg" in line


def test_unregistered_and_wrong_keys(coordinator: tuple[str, str, Path]) -> None:
    address, rest, _ = coordinator
    stranger = FederationClient(address, Identity.generate())
    with pytest.raises(TransportError, match="not registered here; run `gym-client join`"):
        stranger.poll(0.1)
    # a registered contributor id, but requests signed with another key
    owner = Identity.generate()
    FederationClient(address, owner).register("owner")
    impostor = FederationClient(address, Identity.generate())
    impostor._auth = lambda method, digest: _forged_auth(owner.contributor_id, method, digest)  # type: ignore[method-assign]
    with pytest.raises(TransportError, match="signature does not match your registered key"):
        impostor.poll(0.1)
    assert serving(address, rest)


def _forged_auth(contributor_id: str, method: str, digest: str):  # type: ignore[no-untyped-def]
    from zoo_gym.core.protocol import request_statement
    from zoo_gym.proto.v1 import federation_pb2 as pb

    ts = int(time.time() * 1000)
    other = Identity.generate()
    nonce = os.urandom(16)
    return pb.Auth(
        contributor_id=contributor_id,
        timestamp_ms=ts,
        nonce=nonce,
        signature=other.sign(request_statement(method, contributor_id, ts, nonce, digest)),
    )


def test_clock_off(coordinator: tuple[str, str, Path]) -> None:
    address, rest, _ = coordinator
    client = FederationClient(address, Identity.generate(), clock=lambda: time.time() - 3600)
    with pytest.raises(TransportError, match=r"your clock is 3600 s behind the coordinator's"):
        client.register("late")
    assert serving(address, rest)


def _task(client: FederationClient) -> ReceivedTask:
    for _ in range(60):
        task = client.poll(2.0)
        if task is not None:
            return task
    pytest.fail("no task was sent")


def test_bad_submissions_are_refused_and_accepted_one_is_kept(
    coordinator: tuple[str, str, Path],
) -> None:
    """Refusals before the payload is read keep the task open; a recorded rejection answers it."""
    import sqlite3

    address, rest, home = coordinator
    me = Identity.generate()
    client = FederationClient(address, me)
    client.register("me")
    task = _task(client)
    config = TaskConfig.from_record(task.message.content.config_records[TASK_CONFIG])
    payload = zero_update(config, home)

    oversized = signed_reply(me, task.message, config, os.urandom(70_000), {})
    with pytest.raises(TransportError, match="exceeds the 65536-byte limit"):
        client.submit(task, oversized)

    truncated = signed_reply(me, task.message, config, payload, {})
    original = client.stub.SubmitUpdate

    def cut(chunks, **kw):  # type: ignore[no-untyped-def]
        items = list(chunks)
        items[-1].data = items[-1].data[: len(items[-1].data) // 2]
        return original(iter(items), **kw)

    client.stub.SubmitUpdate = cut  # type: ignore[method-assign]
    with pytest.raises(TransportError, match="truncated"):
        client.submit(task, truncated)
    client.stub.SubmitUpdate = original  # type: ignore[method-assign]
    assert serving(address, rest)

    stale_round = signed_reply(
        me, task.message, dataclasses.replace(config, round=config.round + 5), payload, {}
    )
    result = client.submit(task, stale_round)
    assert not result.accepted and "stale round" in result.reason

    task = _task(client)  # the rejection answered round 1; round 2 brings a new task
    config = TaskConfig.from_record(task.message.content.config_records[TASK_CONFIG])
    assert config.round == 2
    stale_base = signed_reply(
        me, task.message, dataclasses.replace(config, base_version="v0009"), payload, {}
    )
    result = client.submit(task, stale_base)
    assert not result.accepted and "stale base" in result.reason

    task = _task(client)
    config = TaskConfig.from_record(task.message.content.config_records[TASK_CONFIG])
    garbage = signed_reply(me, task.message, config, b"ZGDE" + b"\x00" * 40, {})
    result = client.submit(task, garbage)
    assert not result.accepted and "envelope is invalid" in result.reason
    assert serving(address, rest)

    task = _task(client)
    config = TaskConfig.from_record(task.message.content.config_records[TASK_CONFIG])
    good = signed_reply(me, task.message, config, payload, {"num_examples": 1.0})
    result = client.submit(task, good)
    assert result.accepted, result.reason
    again = signed_reply(me, task.message, config, payload, {"num_examples": 1.0})
    with pytest.raises(TransportError, match="no open task"):
        client.submit(task, again)

    db = sqlite3.connect(home / "ledger.db")
    rows = db.execute(
        "SELECT round_number, decision, reason FROM submissions WHERE contributor_id = ? ORDER BY id",
        (me.contributor_id,),
    ).fetchall()
    decisions = [d for _, d, _ in rows]
    assert decisions == ["rejected"] * 4 + ["accepted", "rejected"]  # the resend is recorded too
    assert "exceeds" in rows[0][2] and "no open task" in rows[-1][2]
    assert [r for r, d, _ in rows if d == "accepted"] == [4]
    assert serving(address, rest)
