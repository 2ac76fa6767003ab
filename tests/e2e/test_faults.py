"""Faults, with real processes on 127.0.0.1 stopped by PID.

- a contributor killed (SIGKILL) mid-upload: the round completes without it, nothing half-written
  stays in the spool, and the restarted contributor takes part in the next round;
- the coordinator killed (SIGKILL) mid-round and restarted: the accepted submissions and the ledger
  survive, `gym-coordinator ledger verify` passes, the interrupted round is recorded aborted and the
  next round completes with every contributor, a real `gym-client join` among them, reconnecting
  on its own;
- a contributor whose clock is off: beyond `clock_skew_s` it is refused with one clear line,
  within it the round works (`clock_offset_s` in the client config shifts its clock);
- a corrupt model file on a contributor: detected by its hash, downloaded again, the round proceeds.

The first two use simulated contributors (this file run as a script: the real transport client and
the client's reconnecting `Link`, no training) so the kill lands at a known point; the last two,
and one contributor of the restart, run the real `gym-client join`.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from zoo_gym.simulation.demo import free_port

pytestmark = pytest.mark.e2e

PY = sys.executable


def _stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


class Procs:
    """Processes of one test, each logging to its own file; all stopped by PID at the end."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.running: dict[str, subprocess.Popen[bytes]] = {}

    def spawn(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        log = (self.workdir / f"{name}.log").open("ab")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        log.close()
        self.running[name] = proc
        return proc

    def log(self, name: str) -> str:
        return (self.workdir / f"{name}.log").read_text(errors="replace")

    def wait_log(self, name: str, text: str, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while text not in self.log(name):
            if time.monotonic() > deadline:
                pytest.fail(f"{name} never logged {text!r}:\n{self.log(name)[-2000:]}")
            time.sleep(0.2)

    def stop_all(self) -> None:
        for proc in self.running.values():
            _stop(proc)


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    p = Procs(tmp_path)
    yield p
    p.stop_all()


def configure(home: Path, settings: str, training: str = "") -> tuple[str, str]:
    port, rest = free_port(), free_port()
    config = home / "coordinator.toml"
    text = re.sub(r"(?m)^(rest_)?listen = .*\n", "", config.read_text())
    for key in re.findall(r"(?m)^(\w+) = ", training):
        text = re.sub(rf"(?m)^{key} = .*\n", "", text)
    config.write_text(
        text.replace(
            "[training]",
            (
                f'listen = "127.0.0.1:{port}"\nrest_listen = "127.0.0.1:{rest}"\n{settings}\n\n[training]\n{training}'
            ),
            1,
        )
    )
    return f"127.0.0.1:{port}", f"http://127.0.0.1:{rest}"


def serve(
    procs: Procs, home: Path, rest: str, name: str = "coordinator"
) -> subprocess.Popen[bytes]:
    proc = procs.spawn(
        name, [PY, "-m", "zoo_gym.cli.coordinator", "serve", "-c", str(home / "coordinator.toml")]
    )
    for _ in range(240):
        try:
            if httpx.get(f"{rest}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.25)
    pytest.fail(procs.log(name)[-3000:])


def simulated(
    procs: Procs, name: str, address: str, home: Path, key: Path, *flags: str
) -> subprocess.Popen[bytes]:
    return procs.spawn(name, [PY, __file__, address, str(home), str(key), *flags])


def ledger_rows(home: Path, sql: str) -> list[tuple[object, ...]]:
    db = sqlite3.connect(home / "ledger.db")
    try:
        return db.execute(sql).fetchall()
    finally:
        db.close()


def wait_for(check: Callable[[], bool], what: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.25)


def summaries(home: Path) -> list[dict[str, object]]:
    path = home / "rounds.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def test_contributor_killed_mid_upload(tiny_home: Path, tmp_path: Path, procs: Procs) -> None:
    # Prepare: two contributors; b uploads slowly and is killed mid-upload in round 1
    address, rest = configure(
        tiny_home, "rounds = 2\nmin_clients = 2\nround_timeout_s = 25\nwait_for_clients_s = 120"
    )
    coordinator = serve(procs, tiny_home, rest)
    a = simulated(procs, "a", address, tiny_home, tmp_path / "a.key", "--rounds", "2")
    b = simulated(procs, "b", address, tiny_home, tmp_path / "b.key", "--slow-upload")

    # Execute
    procs.wait_log("b", "uploading round 1 slowly")
    time.sleep(1.0)  # header and a few chunks are in
    os.killpg(b.pid, signal.SIGKILL)
    b.wait()
    # restarted at once; it lost its work, so it lets round 1 go (its task stays assigned to it)
    b_again = simulated(
        procs, "b2", address, tiny_home, tmp_path / "b.key", "--rounds", "1", "--skip-round", "1"
    )
    wait_for(lambda: coordinator.poll() is not None, "the coordinator to finish its 2 rounds", 180)
    a.wait(timeout=60)
    b_again.wait(timeout=60)

    # Assert: round 1 completed with a alone, round 2 with both; b's partial upload left nothing behind
    assert coordinator.returncode == 0, procs.log("coordinator")[-3000:]
    rows = summaries(tiny_home)
    assert [(r["round"], r["participants"], r["accepted"]) for r in rows] == [(1, 2, 1), (2, 2, 2)]
    assert rows[0]["status"] in ("published", "rolled_back")
    subs = ledger_rows(tiny_home, "SELECT round_number, decision FROM submissions ORDER BY id")
    assert sorted(subs) == [(1, "accepted"), (2, "accepted"), (2, "accepted")]
    assert not list((tiny_home / "spool").glob("*.part"))
    assert "round 2: accepted" in procs.log("b2")


def test_coordinator_killed_mid_round_and_restarted(
    tiny_home: Path, tmp_path: Path, procs: Procs
) -> None:
    # Prepare: a (simulated) and c (a real `gym-client join`) submit in round 1, b holds its
    # round-1 task; the coordinator dies before the round closes
    address, rest = configure(
        tiny_home,
        "rounds = 1\nmin_clients = 3\nround_timeout_s = 120\nwait_for_clients_s = 60",
        "steps = 2\nbatch_size = 4\nmax_length = 48",
    )
    serve(procs, tiny_home, rest, "coordinator-1")
    a = simulated(procs, "a", address, tiny_home, tmp_path / "a.key", "--rounds", "2")
    b = simulated(
        procs, "b", address, tiny_home, tmp_path / "b.key", "--rounds", "1", "--skip-round", "1"
    )
    c_home = _client_home(tmp_path, "c", address)
    c = procs.spawn("c", _join_argv(c_home, address, rounds=2))
    wait_for(
        lambda: (
            len(ledger_rows(tiny_home, "SELECT id FROM submissions WHERE decision = 'accepted'"))
            == 2
        ),
        "a's and c's round-1 submissions",
        180,
    )
    procs.wait_log("b", "holding round 1")

    # Execute: SIGKILL mid-round, verify the ledger, restart
    os.killpg(procs.running["coordinator-1"].pid, signal.SIGKILL)
    procs.running["coordinator-1"].wait()
    verify_dead = _verify_ledger(tiny_home)
    restarted = serve(procs, tiny_home, rest, "coordinator-2")
    restarted.wait(timeout=240)
    for name, proc in (("a", a), ("b", b), ("c", c)):
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{name} did not finish round 2:\n{procs.log(name)[-3000:]}")
    verify_after = _verify_ledger(tiny_home)

    # Assert: the ledger survived and verifies, round 1 is aborted, round 2 had all three
    assert verify_dead.returncode == 0, verify_dead.stdout + verify_dead.stderr
    assert verify_after.returncode == 0, verify_after.stdout + verify_after.stderr
    assert restarted.returncode == 0, procs.log("coordinator-2")[-3000:]
    rounds = ledger_rows(tiny_home, "SELECT number, status FROM rounds ORDER BY number")
    assert (
        rounds[0] == (1, "aborted")
        and rounds[1][0] == 2
        and rounds[1][1] in ("published", "rolled_back")
    )
    subs = ledger_rows(tiny_home, "SELECT round_number, decision FROM submissions ORDER BY id")
    assert sorted(subs) == [(1, "accepted")] * 2 + [(2, "accepted")] * 3
    reason = ledger_rows(tiny_home, "SELECT metrics FROM rounds WHERE number = 1")[0][0]
    assert "coordinator restarted during the round" in str(reason)
    # the real client rode out the restart: it lost the coordinator, found it again, and
    # contributed to the next round without being started again
    assert c.returncode == 0, procs.log("c")[-3000:]
    log = procs.log("c")
    assert "lost the coordinator" in log and f"reconnected to {address}" in log
    assert "round 2: uploaded" in log
    assert log.index("reconnected") < log.index("round 2: training")


def _verify_ledger(home: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            PY,
            "-m",
            "zoo_gym.cli.coordinator",
            "ledger",
            "verify",
            "-c",
            str(home / "coordinator.toml"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )


def _client_home(tmp_path: Path, name: str, address: str, extra: str = "") -> Path:
    from zoo_gym.core.synthetic import make_examples, write_jsonl

    home = tmp_path / name
    subprocess.run(
        [PY, "-m", "zoo_gym.cli.client", "init", "--home", str(home), "--name", name],
        check=True,
        capture_output=True,
        timeout=120,
    )
    write_jsonl(make_examples(16, seed=3), home / "data.jsonl")
    config = home / "client.toml"
    config.write_text(config.read_text() + extra)
    return home


def _join_argv(home: Path, address: str, *, rounds: int = 1) -> list[str]:
    return [
        PY,
        "-m",
        "zoo_gym.cli.client",
        "join",
        address,
        "--home",
        str(home),
        "--data",
        str(home / "data.jsonl"),
        "--max-rounds",
        str(rounds),
    ]


def _join(home: Path, address: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(_join_argv(home, address), capture_output=True, text=True, timeout=300)


def test_skewed_clock_and_corrupt_model_file(tiny_home: Path, tmp_path: Path, procs: Procs) -> None:
    # Prepare: a real coordinator (skew limit 300 s), real clients with shifted clocks
    address, rest = configure(
        tiny_home,
        "rounds = 1\nmin_clients = 1\nround_timeout_s = 120\nclock_skew_s = 300",
        "steps = 2\nbatch_size = 4\nmax_length = 48",
    )
    coordinator = serve(procs, tiny_home, rest)
    late = _client_home(tmp_path, "late", address, "clock_offset_s = -3600\n")
    near = _client_home(tmp_path, "near", address, "clock_offset_s = 120\n")
    # near already holds v0000, but its weights are corrupt (same size, one byte changed)
    models = near / "state" / "models"
    models.mkdir(parents=True)
    import shutil

    shutil.copytree(tiny_home / "models" / "v0000", models / "v0000")
    weights = models / "v0000" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-100] ^= 0xFF
    weights.write_bytes(bytes(data))

    # Execute
    refused = _join(late, address)
    joined = _join(near, address)
    coordinator.wait(timeout=240)

    # Assert: beyond the skew one clear line; within it the round works after the model is fetched again
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    lines = [x for x in refused.stderr.splitlines() if x.strip()]
    assert (
        len(lines) == 1
        and "your clock is 3600 s behind the coordinator's (limit 300 s)" in lines[0]
    ), refused.stderr
    assert joined.returncode == 0, joined.stdout + joined.stderr
    assert (
        "model v0000 on disk failed its check" in joined.stdout
        and "downloading it again" in joined.stdout
    )
    assert "round 1: uploaded" in joined.stdout and "accepted" in joined.stdout
    from zoo_gym.core.hashing import sha256_file

    assert sha256_file(weights) == sha256_file(tiny_home / "models" / "v0000" / "model.safetensors")
    assert ledger_rows(tiny_home, "SELECT decision FROM submissions") == [("accepted",)]


# --- a simulated contributor (run as a script by the tests above) -------------------------------


def _contributor(argv: list[str]) -> int:
    import argparse

    from zoo_gym.client.link import Link
    from zoo_gym.client.runtime import signed_reply
    from zoo_gym.core.identity import Identity
    from zoo_gym.core.protocol import TASK_CONFIG, TaskConfig
    from zoo_gym.transport.client import FederationClient, TransportError

    parser = argparse.ArgumentParser()
    parser.add_argument("address")
    parser.add_argument("coordinator_home", type=Path)
    parser.add_argument("key", type=Path)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--slow-upload", action="store_true")
    parser.add_argument("--skip-round", type=int, default=0)
    args = parser.parse_args(argv)
    if args.key.exists():
        me = Identity.load(args.key)
    else:
        me = Identity.generate()
        me.save(args.key)
    client = FederationClient(args.address, me, timeout_s=10)
    link = Link(client, args.key.stem, reconnect_for_s=600)
    while True:  # first contact: the coordinator may still be starting
        try:
            link.register()
            break
        except TransportError as exc:
            print("waiting:", exc, flush=True)
            time.sleep(0.5)
    done, skipped = 0, False
    while done < args.rounds:
        task = link.call(lambda: client.poll(1.0))
        if task is None:
            continue
        config = TaskConfig.from_record(task.message.content.config_records[TASK_CONFIG])
        if config.round == args.skip_round:
            if not skipped:
                print(f"holding round {config.round}", flush=True)
                skipped = True
            time.sleep(0.5)
            continue
        reply = signed_reply(
            me,
            task.message,
            config,
            _zero_update(config, args.coordinator_home),
            {"num_examples": 1.0},
        )
        if args.slow_upload:
            print(f"uploading round {config.round} slowly", flush=True)
            _slow_submit(client, task, reply)
        result = link.submit(task, reply)
        assert result is not None
        print(
            f"round {config.round}: {'accepted' if result.accepted else 'rejected'}: {result.reason}",
            flush=True,
        )
        done += 1
    client.close()
    return 0


def _zero_update(task: object, home: Path) -> bytes:
    import torch

    from zoo_gym.compression import CodecSpec, encode
    from zoo_gym.core.lora import LoraSpec, update_shapes
    from zoo_gym.core.weights import load_weights

    state = load_weights(home / "models" / "v0000")
    spec = LoraSpec(rank=task.lora_rank, alpha=task.lora_alpha, target_modules=task.target_modules)  # type: ignore[attr-defined]
    shapes = update_shapes(state, adapter="ffa_lora", spec=spec)
    delta = {key: torch.zeros(shape) for key, shape in shapes.items()}
    return encode(delta, CodecSpec(task.codec, task.group_size))  # type: ignore[attr-defined]


def _slow_submit(client: object, task: object, reply: object) -> None:
    """Stream the submission 256 bytes a second (never finishes before the kill)."""
    from flwr.app import Message

    from zoo_gym.proto.v1 import federation_pb2 as pb
    from zoo_gym.transport.records import header_of, unpack_reply
    from zoo_gym.transport.server import serialize_message

    sub, payload, rest = unpack_reply(reply)  # type: ignore[arg-type]
    header = header_of(
        sub,
        client._auth("submit", f"{sub.message_id}|{sub.payload_sha256}"),  # type: ignore[attr-defined]
        serialize_message(Message(rest, reply_to=task.message)),  # type: ignore[attr-defined]
    )

    def chunks() -> Iterator[pb.UpdateChunk]:
        yield pb.UpdateChunk(header=header)
        for start in range(0, len(payload), 256):
            time.sleep(1.0)
            yield pb.UpdateChunk(data=payload[start : start + 256])

    client.stub.SubmitUpdate(chunks(), timeout=600)  # type: ignore[attr-defined]


if __name__ == "__main__":
    sys.exit(_contributor(sys.argv[1:]))
