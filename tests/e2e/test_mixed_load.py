"""Mixed load: hostile connections on every port while honest contributors complete a round.

The coordinator is a real `gym-coordinator serve` on 127.0.0.1 with its DEFAULT limits. Honest
contributors are threads of this process, each with its own identity and gRPC channel (the real
`FederationClient`): register (before the attack: they are the network's members), long-poll for
the round's task, submit an envelope of the round's B matrices in the round's codec (random N(0, 1e-3) values; no training runs, so the round's time
is the coordinator's). Like the contributor's `Link`, they take RESOURCE_EXHAUSTED as "later".

The hostile side comes from 127.0.0.2 and up, all at once and for the whole round:
- SubmitUpdate streams that never send their header and PollTask calls that never send their
  request, one per connection, opened again every 5 s (`hostile.Flood`);
- floods of tokens that verify for nothing on REST (`hostile_rest.bad_token_flood`);
- 64 MiB request bodies, declared and chunked (`hostile_rest.oversized_body`);
- registration floods of fresh keys, each through its own source address
  (`hostile_registration.flood` via `SourceProxy`).

Measured, on two fresh coordinators (one quiet, one under attack): the honest round time (from
the registered contributors' first poll to the round's record in rounds.jsonl), how long a
newcomer's fresh key, registered by the contributor's own `Link`, waits to be admitted meanwhile
(it competes with the registration flood for the overall registration allowance), and the coordinator's peak RSS (VmHWM) against its RSS
when idle.

The small variant runs in the default suite; the full one (10 honest, about 200 hostile
connections, quiet baseline beside it) is slow-marked and prints its table:

    .venv/bin/pytest -m slow tests/e2e/test_mixed_load.py -s
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from hostile import Flood
from hostile_registration import SourceProxy, flood
from hostile_rest import bad_token_flood, oversized_body
from serve_process import ServeProcess, serve

from zoo_gym.client.link import Link
from zoo_gym.client.runtime import signed_reply
from zoo_gym.compression import CodecSpec, encode
from zoo_gym.core.identity import Identity
from zoo_gym.core.lora import LoraSpec, update_shapes
from zoo_gym.core.protocol import TASK_CONFIG, TaskConfig
from zoo_gym.core.weights import load_weights
from zoo_gym.transport.client import FederationClient, ReceivedTask, SubmitResult, TransportError

pytestmark = pytest.mark.e2e

MIB = 1 << 20
HOLD_S = 15.0  # the attack lasts at least this long: the default first-message deadline + 5 s
ROUND = {"rounds": 1, "wait_for_clients_s": 120, "round_timeout_s": 300}


def patient(call: Callable[[], object], *, for_s: float = 120.0) -> object:
    """`call()`, again after a pause while the coordinator answers "over a limit" or is busy."""
    deadline = time.monotonic() + for_s
    while True:
        try:
            return call()
        except TransportError as exc:
            if not (exc.transient or exc.code == "RESOURCE_EXHAUSTED"):
                raise
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)


def round_shapes(home: Path, task: TaskConfig) -> dict[str, tuple[int, int]]:
    state = load_weights(home / "models" / "v0000")
    spec = LoraSpec(rank=task.lora_rank, alpha=task.lora_alpha, target_modules=task.target_modules)
    shapes = update_shapes(state, adapter=task.adapter, spec=spec)
    return {k: (s[0], s[1]) for k, s in shapes.items()}


def contribute(
    home: Path, address: str, results: dict[str, str], registered: threading.Barrier
) -> None:
    """One honest contributor: registers, waits at `registered` for the others (and the attack),
    then does the round; its outcome ("accepted", or what went wrong) in `results`."""
    me = Identity.generate()
    client = FederationClient(address, me, timeout_s=60)
    try:
        patient(lambda: client.register(me.contributor_id[:8]))
        registered.wait(timeout=120)
        task: ReceivedTask | None = None
        while task is None:
            task = patient(lambda: client.poll(5.0))  # type: ignore[assignment]
        config = TaskConfig.from_record(task.message.content.config_records[TASK_CONFIG])
        generator = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "big"))
        delta = {
            k: torch.randn(shape, generator=generator) * 1e-3
            for k, shape in round_shapes(home, config).items()
        }
        payload = encode(delta, CodecSpec(config.codec, config.group_size))
        reply = signed_reply(me, task.message, config, payload, {"num_examples": 8.0})
        sent: SubmitResult = patient(lambda: client.submit(task, reply))  # type: ignore[assignment]
        results[me.contributor_id] = "accepted" if sent.accepted else sent.reason
    except Exception as exc:  # recorded and asserted on by the test
        results[me.contributor_id] = f"{type(exc).__name__}: {exc}"
    finally:
        client.close()


@dataclass
class Hostiles:
    """Every attack of the module docstring, running in threads until `stop`."""

    answers: dict[str, Counter[str]] = field(default_factory=dict)
    streams: list[Flood] = field(default_factory=list)
    threads: list[threading.Thread] = field(default_factory=list)
    stopped: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, kind: str, answer: object) -> None:
        with self.lock:
            self.answers.setdefault(kind, Counter())[str(answer)] += 1

    def loop(self, kind: str, attack: Callable[[], Counter[str] | Counter[int] | object]) -> None:
        def run() -> None:
            while not self.stopped.is_set():
                answer = attack()
                if isinstance(answer, Counter):
                    for key, n in answer.items():
                        with self.lock:
                            self.answers.setdefault(kind, Counter())[str(key)] += n
                else:
                    self.count(kind, getattr(answer, "status", answer))
                self.stopped.wait(0.05)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        self.threads.append(thread)

    def stop(self) -> None:
        self.stopped.set()
        for thread in self.threads:
            thread.join(timeout=60)
        for streams in self.streams:
            streams.close()
            self.answers[f"grpc {streams.method}"] = Counter(streams.codes())

    def connections(self) -> int:
        return sum(s.n for s in self.streams) + len(self.threads)


def source(i: int) -> str:
    return f"127.0.0.{2 + i % 250}"


@contextmanager
def attacked(served: ServeProcess, *, streams: int, rest_threads: int) -> Iterator[Hostiles]:
    """Start every attack on `served`: `streams` held gRPC calls (two thirds uploads without a
    header, one third polls without a request) and `rest_threads` threads of each REST and
    registration attack, each from its own address."""
    hostiles = Hostiles()
    with ExitStack() as stack:
        for method, n in (("SubmitUpdate", streams * 2 // 3), ("PollTask", streams // 3)):
            addresses = tuple(source(i) for i in range(8))
            held = Flood(served.address, n, method=method, sources=addresses, per_connection=1)
            held.method, held.n = method, n  # type: ignore[attr-defined]
            hostiles.streams.append(held)
        for i in range(rest_threads):
            where = source(20 + i)
            hostiles.loop(
                "rest bad token",
                lambda where=where: bad_token_flood(served.rest, count=20, source=where),  # type: ignore[misc]
            )
            hostiles.loop(
                "rest 64 MiB body",
                lambda i=i, where=where: oversized_body(
                    served.rest, chunked=i % 2 == 1, source=where
                ),  # type: ignore[misc]
            )
            proxy = stack.enter_context(SourceProxy(source(100 + i), served.address))
            hostiles.loop(
                "register fresh key",
                lambda proxy=proxy: flood(proxy.address, 10, stop=hostiles.stopped),  # type: ignore[misc]
            )
        started = time.monotonic()
        try:
            time.sleep(2.0)  # every attack is under way before the first honest call
            yield hostiles
            # outlast the server's first-message deadline, so it is the server that ends calls
            time.sleep(max(0.0, started + HOLD_S - time.monotonic()))
        finally:
            hostiles.stop()


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def newcomer(address: str) -> float:
    """Seconds a fresh key takes to be admitted: `gym-client join`'s own `Link` registers it,
    waiting as the coordinator tells it to while it says busy."""
    me = Identity.generate()
    client = FederationClient(address, me, timeout_s=60)
    started = time.perf_counter()
    try:
        Link(client, "newcomer", reconnect_for_s=300, say=lambda line: None).register()
    finally:
        client.close()
    return time.perf_counter() - started


@dataclass(frozen=True)
class Run:
    wall_s: float
    newcomer_s: float
    coordinator_cpu_s: float
    test_cpu_s: float
    peak_rss_mib: float
    idle_rss_mib: float
    results: dict[str, str]
    ledger: list[tuple[str, str, str]]


def one_round(
    home: Path, *, honest: int, streams: int = 0, rest_threads: int = 0
) -> tuple[Run, Hostiles | None]:
    """A real serve on `home`; `honest` registered contributors complete one round, attacked
    or not, and a newcomer registers meanwhile."""
    with serve(home, stay=True, min_clients=honest, **ROUND) as served, ExitStack() as stack:
        time.sleep(0.5)
        idle_kib = served.rss_kib()
        results: dict[str, str] = {}
        registered = threading.Barrier(honest + 1)
        workers = [
            threading.Thread(target=contribute, args=(home, served.address, results, registered))
            for _ in range(honest)
        ]
        for w in workers:
            w.start()
        hostiles = None
        if streams or rest_threads:
            hostiles = stack.enter_context(
                attacked(served, streams=streams, rest_threads=rest_threads)
            )
        registered.wait(timeout=120)
        started = time.perf_counter()
        cpu0 = cpu_s(served.proc.pid), time.process_time()  # coordinator, attackers + honest
        joined: list[float] = []
        late = threading.Thread(target=lambda: joined.append(newcomer(served.address)))
        late.start()
        rounds = home / "rounds.jsonl"
        deadline = time.monotonic() + 400
        while not rounds.exists() and time.monotonic() < deadline and served.proc.poll() is None:
            time.sleep(0.02)  # the round time is read to 20 ms
        wall = time.perf_counter() - started
        cpu = cpu_s(served.proc.pid) - cpu0[0], time.process_time() - cpu0[1]
        for w in [*workers, late]:
            w.join(timeout=300)
        peak_kib = served.rss_kib("VmHWM") if served.proc.poll() is None else 0
        assert rounds.exists(), served.log[-4000:]
        stack.close()  # the attacks end before serve is stopped
    db = sqlite3.connect(home / "ledger.db")
    rows = db.execute(
        "SELECT contributor_id, decision, reason FROM submissions WHERE round_number = 1"
    ).fetchall()
    db.close()
    run = Run(
        wall,
        joined[0] if joined else float("nan"),
        *cpu,
        peak_kib / 1024,
        idle_kib / 1024,
        results,
        rows,
    )
    return run, hostiles


def assert_honest_round(run: Run, honest: int) -> None:
    failures = {k: v for k, v in run.results.items() if v != "accepted"}
    assert len(run.results) == honest and not failures, list(failures.values())[:3]
    # every honest submission is in the ledger, accepted, exactly once
    assert sorted(r[0] for r in run.ledger) == sorted(run.results)
    assert all(r[1] == "accepted" for r in run.ledger)


def assert_attacks_refused(hostiles: Hostiles) -> None:
    answers = hostiles.answers
    # REST: no bad token was served, no oversized body was read
    assert set(answers["rest bad token"]) <= {"401", "429"}, answers["rest bad token"]
    assert set(answers["rest 64 MiB body"]) <= {"413", "None"}, answers["rest 64 MiB body"]
    assert answers["rest 64 MiB body"]["413"] > 0
    # gRPC: the server ended held calls (over a limit, or no request in time); the others were
    # still inside their first-message deadline when the attack closed its connections
    for method in ("SubmitUpdate", "PollTask"):
        ended = answers[f"grpc {method}"]
        assert set(ended) <= {"RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED", "connection"}, ended
        assert ended["RESOURCE_EXHAUSTED"] + ended["DEADLINE_EXCEEDED"] > 0, ended


def copy_home(home: Path, to: Path) -> Path:
    shutil.copytree(home, to)
    return to


def test_honest_round_completes_under_mixed_attack(tiny_home: Path) -> None:
    run, hostiles = one_round(tiny_home, honest=3, streams=60, rest_threads=2)

    assert_honest_round(run, 3)
    assert hostiles is not None
    assert_attacks_refused(hostiles)
    # 64 MiB bodies were sent over and over: none of them reached memory
    assert run.peak_rss_mib - run.idle_rss_mib < 200, (run.idle_rss_mib, run.peak_rss_mib)


@pytest.mark.slow
def test_mixed_load_against_a_quiet_round(tiny_home: Path, tmp_path: Path) -> None:
    quiet_home = copy_home(tiny_home, tmp_path / "quiet")
    quiet, _ = one_round(quiet_home, honest=10)
    loud, hostiles = one_round(tiny_home, honest=10, streams=120, rest_threads=26)

    assert_honest_round(quiet, 10)
    assert_honest_round(loud, 10)
    assert hostiles is not None
    assert_attacks_refused(hostiles)
    print(f"\nhostile connections held at once: about {hostiles.connections()}")
    print(
        "| run | honest round s | coordinator CPU s | test process CPU s "
        "| newcomer admitted after s | idle RSS MiB | peak RSS MiB |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, run in (("quiet", quiet), ("under attack", loud)):
        print(
            f"| {name} | {run.wall_s:.2f} | {run.coordinator_cpu_s:.1f} | {run.test_cpu_s:.1f} "
            f"| {run.newcomer_s:.2f} | {run.idle_rss_mib:.0f} | {run.peak_rss_mib:.0f} |"
        )
    print(f"honest round time, attack / quiet: {loud.wall_s / quiet.wall_s:.2f}")
    for kind, answers in sorted(hostiles.answers.items()):
        print(f"{kind}: {dict(answers)}")
    assert loud.peak_rss_mib - quiet.peak_rss_mib < 256, (quiet, loud)
