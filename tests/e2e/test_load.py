"""Load: N contributors submit S-byte envelopes in one round to a real coordinator process.

What is simulated: N contributors with their own Ed25519 identities, each a thread of this test
process with its own gRPC channel (the real `FederationClient`): register, long-poll for the
round's task, sign and stream an envelope of the round's B matrices (random N(0, 1e-3) values,
codec `none` = float32, LoRA rank chosen so the envelope is S bytes: 1024 x rank x 4 bytes on the
tiny model). No training runs; the coordinator is the real `gym-coordinator serve` process
(intake, ledger, FedAvg, quality gate, REST) on 127.0.0.1 with its default gRPC limits. All
contributors share 127.0.0.1, as contributors behind one NAT do; each talks through the client's
`Link`, which waits and tries again when the coordinator says it is busy.

Measured: every submission's ledger row (decision and reason), the coordinator's memory (VmRSS
sampled every 20 ms and VmHWM from /proc/PID/status) against the sum of the payloads, the
latency of REST `/health` polled every 50 ms while the round runs, from a separate process (this
one holds every simulated contributor's thread), and intake as the contributors see it: each
upload's latency (the streamed submission until the coordinator's verdict) and the throughput,
submissions over the time from the first upload's start to the last verdict.

CI runs N=20, S=1 MB and N=100, S=32 KiB (rank 8, what a tiny-model round sends). Marked slow:
N=100, S=10 MB and the round of N=1,000 contributors, S=32 KiB:

    .venv/bin/pytest -m slow tests/e2e/test_load.py -s
"""

from __future__ import annotations

import os
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import torch

from zoo_gym.client.link import Link
from zoo_gym.client.runtime import signed_reply
from zoo_gym.compression import CodecSpec, encode
from zoo_gym.core.identity import Identity
from zoo_gym.core.protocol import TASK_CONFIG, TaskConfig
from zoo_gym.simulation.demo import free_port
from zoo_gym.transport.client import FederationClient, SubmitResult

pytestmark = pytest.mark.e2e

LAYOUT_ROWS = 1024  # sum of the output sizes of the tiny model's 14 target modules (2 layers x 7)
MIB = 1 << 20


def status_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


HEALTH_PROBE = """
import sys, time, httpx
url = sys.argv[1]
with httpx.Client(timeout=10) as http:
    while True:
        started = time.perf_counter()
        try:
            ok = http.get(url).status_code == 200
        except httpx.HTTPError:
            ok = False
        print(f"{(time.perf_counter() - started) * 1000:.3f} {int(ok)}", flush=True)
        time.sleep(0.05)
"""


@dataclass
class Probe:
    """Samples the coordinator's RSS in a thread, and REST /health latency from a process of its
    own, so the figure is the coordinator's and not the load generator's: this test process
    runs every simulated contributor, and its threads would hold its GIL against the probe."""

    pid: int
    rest: str
    workdir: Path
    rss_kib: list[int] = field(default_factory=list)
    health_ms: list[float] = field(default_factory=list)
    health_failures: int = 0
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> list[threading.Thread]:
        def rss() -> None:
            while not self.stop.wait(0.02):
                self.rss_kib.append(status_kib(self.pid, "VmRSS"))

        samples = (self.workdir / "health.txt").open("wb")
        self._health = subprocess.Popen(
            [sys.executable, "-c", HEALTH_PROBE, f"{self.rest}/health"], stdout=samples
        )
        samples.close()
        thread = threading.Thread(target=rss, daemon=True)
        thread.start()
        return [thread]

    def finish(self, threads: list[threading.Thread]) -> None:
        self.stop.set()
        for t in threads:
            t.join()
        self._health.terminate()
        self._health.wait(timeout=30)
        for line in (self.workdir / "health.txt").read_text().splitlines():
            ms, ok = line.split()
            self.health_ms.append(float(ms))
            self.health_failures += ok != "1"


@pytest.fixture
def coordinator_factory(tiny_home: Path) -> Iterator[object]:
    procs: list[subprocess.Popen[bytes]] = []

    def start(n: int, rank: int) -> tuple[subprocess.Popen[bytes], str, str]:
        port, rest = free_port(), free_port()
        config = tiny_home / "coordinator.toml"
        text = re.sub(r"(?m)^(rest_)?listen = .*\n", "", config.read_text())
        text = re.sub(r"(?ms)^\[training\].*", "", text)
        text += (
            f'listen = "127.0.0.1:{port}"\nrest_listen = "127.0.0.1:{rest}"\nrounds = 1\nmin_clients = {n}\n'
            f"wait_for_clients_s = {120 + n // 2}\nround_timeout_s = 600\nmax_upload_bytes = {rank * LAYOUT_ROWS * 4 + MIB}\n"
            # every contributor registers from 127.0.0.1 within a second: room for all of them,
            # and for each one's open long poll and upload from that one address (a NAT of n)
            f"registration_burst = {n + 8}\nregistration_burst_per_address = {n + 8}\n"
            f"max_concurrent_per_peer = {max(512, 2 * n + 16)}\ngrpc_burst = {max(400, 4 * n)}\n"
            f"grpc_rate_per_s = {max(100, n)}\n"
            f"grpc_max_unauthenticated_per_peer = {max(64, n + 8)}\n\n"
            f'[training]\ncodec = "none"\nlora_rank = {rank}\n\n[rewards]\nmethod = "none"\n'
        )
        config.write_text(text)
        log = (tiny_home / "serve.log").open("wb")
        proc = subprocess.Popen(
            [sys.executable, "-m", "zoo_gym.cli.coordinator", "serve", "-c", str(config), "--stay"],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        procs.append(proc)
        base = f"http://127.0.0.1:{rest}"
        for _ in range(240):
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    return proc, f"127.0.0.1:{port}", base
            except httpx.HTTPError:
                time.sleep(0.25)
        pytest.fail((tiny_home / "serve.log").read_text()[-3000:])

    yield start
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@dataclass(frozen=True)
class Upload:
    """When one contributor's upload started and got its verdict (perf_counter seconds)."""

    started: float
    ended: float


def contribute(
    address: str,
    shapes: dict[str, tuple[int, int]],
    results: dict[str, SubmitResult | str],
    barrier: threading.Barrier,
    uploads: dict[str, Upload],
) -> None:
    me = Identity.generate()
    client = FederationClient(address, me, timeout_s=120)
    link = Link(client, me.contributor_id[:8], reconnect_for_s=120, say=lambda _: None)
    try:
        link.register()
        barrier.wait(timeout=600)
        task = None
        while task is None:
            task = link.call(lambda: client.poll(10.0))
        config = TaskConfig.from_record(task.message.content.config_records[TASK_CONFIG])
        generator = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "big"))
        delta = {k: torch.randn(shape, generator=generator) * 1e-3 for k, shape in shapes.items()}
        payload = encode(delta, CodecSpec("none", 128))
        del delta
        reply = signed_reply(me, task.message, config, payload, {"num_examples": 1.0})
        started = time.perf_counter()
        results[me.contributor_id] = link.submit(task, reply) or "stopped"
        uploads[me.contributor_id] = Upload(started, time.perf_counter())
    except Exception as exc:  # recorded and asserted on below
        results[me.contributor_id] = f"{type(exc).__name__}: {exc}"
    finally:
        client.close()


def round_shapes(home: Path, rank: int) -> dict[str, tuple[int, int]]:
    """The B matrices a round trains on the tiny base: update key -> (out, rank)."""
    from zoo_gym.core.lora import LoraSpec, update_shapes
    from zoo_gym.core.weights import load_weights

    state = load_weights(home / "models" / "v0000")
    spec = LoraSpec(
        rank=rank,
        alpha=16.0,
        target_modules=TaskConfig(round=1, base_version="", seed=0).target_modules,
    )
    shapes = {
        k: (s[0], s[1]) for k, s in update_shapes(state, adapter="ffa_lora", spec=spec).items()
    }
    assert sum(out for out, _ in shapes.values()) == LAYOUT_ROWS
    return shapes


def run_load(start: object, tiny_home: Path, *, n: int, size_bytes: int) -> dict[str, float]:
    rank = size_bytes // (LAYOUT_ROWS * 4)
    proc, address, rest = start(n, rank)  # type: ignore[operator]
    time.sleep(1.0)
    idle_kib = status_kib(proc.pid, "VmRSS")
    probe = Probe(proc.pid, rest, tiny_home)
    threads = probe.run()
    results: dict[str, SubmitResult | str] = {}
    uploads: dict[str, Upload] = {}
    registered: list[float] = []  # when the last contributor had registered
    barrier = threading.Barrier(n, action=lambda: registered.append(time.perf_counter()))
    shapes = round_shapes(tiny_home, rank)
    workers = [
        threading.Thread(target=contribute, args=(address, shapes, results, barrier, uploads))
        for _ in range(n)
    ]
    started = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=900)
    rounds = tiny_home / "rounds.jsonl"
    deadline = time.monotonic() + 600
    while not rounds.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    wall = time.perf_counter() - started
    probe.finish(threads)
    peak_kib = status_kib(proc.pid, "VmHWM")

    failures = {k: v for k, v in results.items() if isinstance(v, str)}
    assert not failures, list(failures.values())[:3]
    assert rounds.exists(), (tiny_home / "serve.log").read_text()[-3000:]
    sent = [r for r in results.values() if isinstance(r, SubmitResult)]
    db = sqlite3.connect(tiny_home / "ledger.db")
    rows = db.execute(
        "SELECT contributor_id, decision, reason, size_bytes FROM submissions WHERE round_number = 1"
    ).fetchall()
    db.close()
    # every submission is in the ledger, with its decision and reason, exactly once
    assert sorted(r[0] for r in rows) == sorted(results)
    assert all(r[1] in ("accepted", "rejected") and r[2] for r in rows)
    accepted = sum(r[1] == "accepted" for r in rows)
    payload_sum = sum(r.payload_bytes for r in sent)
    health = sorted(probe.health_ms)
    p99 = health[min(len(health) - 1, int(0.99 * len(health)))]
    latencies = sorted(u.ended - u.started for u in uploads.values())
    intake_s = max(u.ended for u in uploads.values()) - min(u.started for u in uploads.values())
    figures = {
        "contributors": n,
        "payload_mib": sent[0].payload_bytes / MIB,
        "accepted": accepted,
        "payload_sum_mib": payload_sum / MIB,
        "idle_rss_mib": idle_kib / 1024,
        "peak_rss_mib": peak_kib / 1024,
        "peak_over_idle_mib": (peak_kib - idle_kib) / 1024,
        "health_p99_ms": p99,
        "health_max_ms": health[-1],
        "health_samples": len(health),
        "health_failures": probe.health_failures,
        "register_all_s": registered[0] - started,
        "intake_per_s": len(uploads) / intake_s,
        "intake_p50_s": latencies[len(latencies) // 2],
        "intake_p99_s": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
        "wall_s": wall,
    }
    print(
        "\nload figures:",
        {k: round(v, 3) if isinstance(v, float) else v for k, v in figures.items()},
    )
    return figures


def test_load_20_contributors_1_mib(coordinator_factory: object, tiny_home: Path) -> None:
    f = run_load(coordinator_factory, tiny_home, n=20, size_bytes=MIB)
    assert f["accepted"] == 20
    # intake spools to disk; with a robust rule aggregation decodes into one (n, d) buffer, about
    # 2 x the payload sum for float32 envelopes: the bound leaves room above that, plus overhead
    assert f["peak_over_idle_mib"] < 3 * f["payload_sum_mib"] + 256
    assert f["health_failures"] == 0 and f["health_p99_ms"] < 1000


def test_a_round_of_100_contributors(coordinator_factory: object, tiny_home: Path) -> None:
    f = run_load(coordinator_factory, tiny_home, n=100, size_bytes=32 * 1024)
    assert f["accepted"] == 100
    assert f["health_failures"] == 0


@pytest.mark.slow
def test_a_round_of_1000_contributors(coordinator_factory: object, tiny_home: Path) -> None:
    f = run_load(coordinator_factory, tiny_home, n=1000, size_bytes=32 * 1024)
    assert f["accepted"] == 1000
    assert f["health_failures"] == 0


@pytest.mark.slow
def test_load_100_contributors_10_mib(coordinator_factory: object, tiny_home: Path) -> None:
    f = run_load(coordinator_factory, tiny_home, n=100, size_bytes=10 * MIB)
    assert f["accepted"] == 100
    assert f["peak_over_idle_mib"] < 3 * f["payload_sum_mib"] + 256
    assert f["health_failures"] == 0 and f["health_p99_ms"] < 2000
