"""Benchmark: wall time of a federated round on the tiny model, zoo-gym against Flower's deployment.

Three runs per client count, same settings on every side (tiny Qwen2, FFA-LoRA rank 8 via
`FfaLoraTrainer`, `--steps` steps of batch 8, lr 0.005, max length 96, 120 synthetic
examples per client, seed 0, OMP_NUM_THREADS=1 everywhere):

1. zoo-gym, real processes (`simulation.demo.Federation`): coordinator + N clients on
   127.0.0.1 over zoo-gym's gRPC. Round time = the coordinator's own `seconds` in rounds.jsonl
   (from task creation to the published version). Round 1 includes waiting for the clients to
   register and load the model, so the comparison uses the last round (warm).
2. zoo-gym, in process (`simulation.inprocess.InProcessFederation`, loopback Grid): the same
   ServerApp/ClientApps with the wire replaced by calls; clients run one after another. The
   phase split comes from this run, by wrapping (in this process only, no product file changes)
   `ClientRuntime.ensure_base` (task out: model copy + verify + load), `FfaLoraTrainer.train_round`
   (local training), the rest of `ClientRuntime.train` (clip + compress + sign),
   `CoordinatorBackend.receive` (validate), `ZooStrategy.aggregate_round` (decode + aggregate) and
   `merge_update` / `Evaluator.loss` / `ModelRegistry.publish` (publish). Upload is measured after
   that run: each client's real last-round reply is streamed with `FederationClient.submit` to a
   gRPC server over the same coordinator backend (the intake refuses it, round closed, after the
   full payload is spooled).
3. Flower (anchor): `flower-superlink --insecure` + N `flower-supernode --insecure` on
   127.0.0.1 (subprocess isolation), `flwr run` of bench/flower_anchor: FedAvg over an
   ArrayRecord of the float32 B matrices, each ClientApp loads the tiny model and trains it with
   the same `FfaLoraTrainer`, central evaluation merges (`merge_update`) and computes the same
   validation loss. Round time = ServerApp timestamps from `configure_train` to the end of
   `evaluate_fn`; also submission (`flwr run`) to completion.

    python bench/round_overhead.py                  # 3 and 10 clients
    python bench/round_overhead.py --clients 3 --steps 10 --skip-flower
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

os.environ["OMP_NUM_THREADS"] = "1"

ROOT = Path(__file__).resolve().parent.parent
ANCHOR_APP = Path(__file__).resolve().parent / "flower_anchor"
EXAMPLES_PER_CLIENT = 120
LR = 0.005
PHASES = ("task out", "train", "compress+sign", "upload", "validate", "decode+aggregate", "publish")


def _training_toml(steps: int) -> str:
    return f'steps = {steps}\nlearning_rate = {LR}\ncodec = "bitdelta"\n'


def _shards(clients: int, seed: int = 0) -> list[list[dict[str, str]]]:
    from zoo_gym.core.synthetic import make_examples, shard

    return shard(make_examples(clients * EXAMPLES_PER_CLIENT, seed=seed + 1), clients)


# --- 1. zoo-gym, real processes -------------------------------------------------------------


def zoo_real(workdir: Path, clients: int, steps: int, rounds: int) -> dict[str, Any]:
    from zoo_gym.simulation.demo import Federation

    fed = Federation(
        workdir,
        clients=clients,
        rounds=rounds,
        steps=steps,
        examples_per_client=EXAMPLES_PER_CLIENT,
    )
    fed.prepare()
    started = time.perf_counter()
    try:
        fed.start()
        fed.wait(timeout_s=900)
        wall = time.perf_counter() - started
    finally:
        fed.stop()
    rows = fed.summaries()
    if len(rows) < rounds or any(r["status"] != "published" for r in rows):
        raise RuntimeError(f"zoo-gym real run did not publish every round: {rows}")
    return {"rounds": [r["seconds"] for r in rows], "wall": wall}


# --- 2. zoo-gym, in process, with phase wrappers --------------------------------------------


class Clock:
    """Seconds per (round, phase); `round` is set when the strategy configures a round."""

    def __init__(self) -> None:
        self.round = 0
        self.t: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.marks: dict[int, dict[str, float]] = defaultdict(dict)

    def wrap(
        self, owner: Any, name: str, phase: str, *, on_start: Callable[[], None] | None = None
    ) -> None:
        original = getattr(owner, name)
        clock = self

        def timed(*args: Any, **kwargs: Any) -> Any:
            if on_start is not None:
                on_start()
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                end = time.perf_counter()
                clock.t[clock.round][phase] += end - start
                clock.marks[clock.round].setdefault(phase + ":first_start", start)
                clock.marks[clock.round][phase + ":last_end"] = end

        setattr(owner, name, timed)


def zoo_inprocess(workdir: Path, clients: int, steps: int, rounds: int) -> dict[str, Any]:
    import torch

    from zoo_gym.client.runtime import ClientRuntime
    from zoo_gym.client.trainers.sft import FfaLoraTrainer
    from zoo_gym.coordinator import rounds as rounds_mod
    from zoo_gym.coordinator.backend import CoordinatorBackend
    from zoo_gym.coordinator.evaluation import Evaluator
    from zoo_gym.coordinator.registry import ModelRegistry
    from zoo_gym.coordinator.setup import init_home
    from zoo_gym.coordinator.strategy import ZooStrategy
    from zoo_gym.simulation.inprocess import InProcessFederation
    from zoo_gym.transport.loopback import LoopbackGrid

    torch.set_num_threads(1)
    home = workdir / "home"
    init_home(
        home,
        tiny=True,
        settings=f'rounds = {rounds}\nmin_clients = {clients}\naggregator = "fedavg"\n',
        training=_training_toml(steps),
    )
    clock = Clock()
    saved = [
        (owner, name, getattr(owner, name))
        for owner, name in (
            (ClientRuntime, "ensure_base"),
            (ClientRuntime, "train"),
            (FfaLoraTrainer, "train_round"),
            (CoordinatorBackend, "receive"),
            (ZooStrategy, "configure_train"),
            (ZooStrategy, "aggregate_round"),
            (Evaluator, "loss"),
            (ModelRegistry, "publish"),
            (rounds_mod, "merge_update"),
            (LoopbackGrid, "_deliver"),
        )
    ]
    captured: dict[int, tuple[Any, Any]] = {}  # node -> (task message, reply) of the last round

    def next_round() -> None:
        clock.round += 1

    try:
        clock.wrap(ZooStrategy, "configure_train", "configure", on_start=next_round)
        clock.wrap(ClientRuntime, "ensure_base", "ensure_base")
        clock.wrap(ClientRuntime, "train", "client_total")
        clock.wrap(FfaLoraTrainer, "train_round", "train")
        clock.wrap(CoordinatorBackend, "receive", "validate")
        clock.wrap(ZooStrategy, "aggregate_round", "aggregate")
        clock.wrap(Evaluator, "loss", "evaluate")
        clock.wrap(ModelRegistry, "publish", "write_version")
        clock.wrap(rounds_mod, "merge_update", "merge")
        clock.wrap(LoopbackGrid, "_deliver", "deliver")

        def tamper(node_id: int, reply: Any) -> Any:
            captured[node_id] = reply
            return reply

        fed = InProcessFederation.build(home, _shards(clients), tamper=tamper)
        summaries = fed.run()
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)
    if len(summaries) < rounds or any(s.status != "published" for s in summaries):
        raise RuntimeError(f"zoo-gym in-process run did not publish every round: {summaries}")
    upload = _grpc_upload(fed, captured, workdir)

    per_round = []
    for number, summary in enumerate(summaries, start=1):
        t, m = clock.t[number], clock.marks[number]
        task_out = (m["deliver:first_start"] - m["configure:first_start"]) + t["ensure_base"]
        publish = summary.seconds - (m["aggregate:last_end"] - m["configure:first_start"])
        phases = {
            "task out": task_out,
            "train": t["train"],
            "compress+sign": t["client_total"] - t["ensure_base"] - t["train"],
            "upload": upload * clients,
            "validate": t["validate"],
            "decode+aggregate": t["aggregate"],
            "publish": publish,
        }
        loopback = t["deliver"] - t["client_total"] - t["validate"]
        per_round.append(
            {
                "phases": phases,
                "total": summary.seconds,
                "loopback_other": loopback,
                "publish_parts": {k: t[k] for k in ("merge", "evaluate", "write_version")},
            }
        )
    return {"rounds": per_round, "upload_each": upload}


def _grpc_upload(fed: Any, captured: dict[int, Any], workdir: Path) -> float:
    """Mean seconds of `FederationClient.submit` of each client's real last reply, over loopback gRPC."""
    from zoo_gym.core.protocol import SUBMISSION, SignedSubmission
    from zoo_gym.transport.client import FederationClient, ReceivedTask
    from zoo_gym.transport.mailbox import Mailbox, PendingTask
    from zoo_gym.transport.server import start_server

    mailbox = Mailbox()
    handle = start_server(
        fed.coordinator.backend, mailbox, address="127.0.0.1:0", spool=workdir / "grpc-spool"
    )
    times = []
    try:
        for node_id, reply in captured.items():
            runtime = fed.runtimes[node_id]
            task_message = _task_message_of(reply)
            sub = SignedSubmission.from_record(reply.content.config_records[SUBMISSION])
            pending = PendingTask(task_message, sub.round, sub.base_version, 0)
            mailbox.put(node_id, pending)
            client = FederationClient(f"127.0.0.1:{handle.port}", runtime.identity)
            try:
                task = ReceivedTask(task_message, pending.round, pending.base_version, 0, 64 << 20)
                start = time.perf_counter()
                client.submit(task, reply)
                times.append(time.perf_counter() - start)
            finally:
                client.close()
    finally:
        handle.stop()
    return sum(times) / len(times)


def _task_message_of(reply: Any) -> Any:
    """A stand-in for the task `reply` answers: same message id, as the mailbox keys on it."""
    from flwr.app import Message, RecordDict

    message = Message(RecordDict(), reply.metadata.src_node_id, "train")
    message.metadata.__dict__["_message_id"] = reply.metadata.reply_to_message_id
    return message


# --- 3. Flower anchor -----------------------------------------------------------------------


def _free_port() -> int:
    from zoo_gym.simulation.demo import free_port

    return free_port()


@contextmanager
def _processes() -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    started: list[tuple[subprocess.Popen[bytes], Any]] = []

    def spawn(argv: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
        fh = log.open("wb")
        proc = subprocess.Popen(
            argv, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        started.append((proc, fh))
        return proc

    try:
        yield spawn
    finally:
        for proc, _ in started:
            if proc.poll() is None:
                with suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc, fh in started:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            fh.close()


def _events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def flower(workdir: Path, clients: int, steps: int, rounds: int) -> dict[str, Any]:
    from zoo_gym.coordinator.setup import init_home
    from zoo_gym.core.synthetic import write_jsonl

    home = workdir / "home"
    init_home(home, tiny=True, settings="", training=_training_toml(steps))
    data = workdir / "data"
    data.mkdir(parents=True)
    for i, part in enumerate(_shards(clients)):
        write_jsonl(part, data / f"shard-{i}.jsonl")
    flwr_home = workdir / "flwr-home"
    flwr_home.mkdir(parents=True)
    app = workdir / "app"
    shutil.copytree(ANCHOR_APP, app, ignore=shutil.ignore_patterns("__pycache__"))
    out = workdir / "events.jsonl"
    port = _free_port()
    (flwr_home / "config.toml").write_text(
        f'[superlink]\ndefault = "bench"\n\n[superlink.bench]\naddress = "127.0.0.1:{port}"\ninsecure = true\n'
    )
    binary = Path(sys.executable).parent
    env = {
        **os.environ,
        # the SuperNode and SuperLink start flwr-clientapp / flwr-serverapp by name: the
        # environment's bin directory goes first on PATH, activated or not
        "PATH": os.pathsep.join([str(binary), os.environ.get("PATH", "")]),
        "FLWR_HOME": str(flwr_home),
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "HOME": str(workdir),
    }
    run_config = " ".join(
        [
            f"num-rounds={rounds}",
            f"min-nodes={clients}",
            f"steps={steps}",
            f'model-dir="{home / "models" / "v0000"}"',
            f'data-dir="{data}"',
            f'validation="{home / "validation.jsonl"}"',
            f'out-file="{out}"',
        ]
    )
    with _processes() as spawn:
        spawn(
            [
                str(binary / "flower-superlink"),
                "--insecure",
                "--disable-runtime-dependency-installation",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
            ],
            workdir / "superlink.log",
            env,
        )
        for i in range(clients):
            spawn(
                [
                    str(binary / "flower-supernode"),
                    "--insecure",
                    "--superlink",
                    f"127.0.0.1:{port}",
                    "--port",
                    str(_free_port()),
                    "--node-config",
                    f"partition-id={i} num-partitions={clients}",
                ],
                workdir / f"supernode-{i}.log",
                env,
            )
        _wait_nodes(workdir, clients)
        submitted = time.time()
        res = subprocess.run(
            [str(binary / "flwr"), "run", str(app), "bench", "--run-config", run_config],
            env=env,
            cwd=workdir,
            capture_output=True,
            text=True,
            timeout=300,
        )
        if res.returncode != 0:
            raise RuntimeError(
                f"flwr run failed ({res.returncode}): {res.stdout[-2000:]} {res.stderr[-2000:]}"
            )
        deadline = time.monotonic() + 900
        while not any(e["event"] == "strategy_end" for e in _events(out)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"Flower run did not finish; see {workdir}")
            time.sleep(0.5)
    events = _events(out)
    done = next(e for e in events if e["event"] == "strategy_end")
    starts = {e["round"]: e["t"] for e in events if e["event"] == "round_start"}
    ends = {e["round"]: e["t"] for e in events if e["event"] == "round_end"}
    client_rows = [e for e in events if e["event"] == "client_train"]
    return {
        "rounds": [ends[r] - starts[r] for r in sorted(ends)],
        "strategy": done["seconds"],
        "submit_to_done": done["t"] - submitted,
        "client_load": sum(e["load_seconds"] for e in client_rows) / max(1, len(client_rows)),
        "client_train": sum(e["train_seconds"] for e in client_rows) / max(1, len(client_rows)),
    }


def _wait_nodes(workdir: Path, clients: int, timeout_s: float = 120.0) -> None:
    """Until every SuperNode's log shows it is up (then a short settle for registration)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        logs = [
            (workdir / f"supernode-{i}.log").read_text(errors="replace") for i in range(clients)
        ]
        if all("Starting Flower SuperNode" in log or "SuperNode" in log for log in logs):
            time.sleep(3.0)
            return
        time.sleep(0.5)
    raise TimeoutError(f"SuperNodes did not start; see {workdir}")


# --- report ---------------------------------------------------------------------------------


def report(
    results: dict[int, dict[str, Any]], steps: int, rounds: int, skipped: frozenset[str]
) -> None:
    """The table; a row of a side the command line skipped says so, and a value missing from
    a side that ran is an error (a measurement that fails is never shown as n/a)."""
    last = rounds - 1
    print(
        f"\nround overhead, tiny model, FFA-LoRA r=8, {steps} steps x batch 8 per client, "
        f"{EXAMPLES_PER_CLIENT} examples/client, OMP_NUM_THREADS=1; round {rounds} of {rounds} (warm) unless noted"
    )
    print(
        "phases: zoo-gym in-process run (loopback Grid, clients one after another, so summed over clients);"
    )
    print(
        "upload: mean loopback-gRPC FederationClient.submit of each client's real envelope, x clients;"
    )
    print(
        "(A): zoo-gym coordinator + clients as processes over gRPC; (B): Flower SuperLink + SuperNodes, FedAvg\n"
    )
    header = f"{'':38s}" + "".join(f"{n:>12d} cl" for n in results)
    print(header)
    print("-" * len(header))

    def row(
        label: str, value: Callable[[dict[str, Any]], float | None], fmt: str = "{:>15.3f}"
    ) -> None:
        cells = []
        for r in results.values():
            try:
                v = value(r)
            except KeyError as missing:
                if missing.args[0] not in skipped:
                    raise
                cells.append(f"{'skipped':>15s}")
                continue
            cells.append(f"{'-':>15s}" if v is None else fmt.format(v))  # one round: no warm one
        print(f"{label:38s}" + "".join(cells))

    for phase in PHASES:
        source = "[gRPC submit x clients]" if phase == "upload" else "[in-process]"
        row(f"  {phase} {source}", lambda r, p=phase: r["inproc"]["rounds"][last]["phases"][p])
    row("    publish: merge", lambda r: r["inproc"]["rounds"][last]["publish_parts"]["merge"])
    row("    publish: evaluate", lambda r: r["inproc"]["rounds"][last]["publish_parts"]["evaluate"])
    row(
        "    publish: write version",
        lambda r: r["inproc"]["rounds"][last]["publish_parts"]["write_version"],
    )
    row("  loopback handling [in-process]", lambda r: r["inproc"]["rounds"][last]["loopback_other"])
    row("  upload per client (gRPC submit)", lambda r: r["inproc"]["upload_each"])
    row("zoo-gym in-process round", lambda r: r["inproc"]["rounds"][last]["total"])
    row("zoo-gym in-process round 1", lambda r: r["inproc"]["rounds"][0]["total"])
    row("zoo-gym real processes, round 1", lambda r: r["real"]["rounds"][0])
    row("zoo-gym real processes, round (A)", lambda r: r["real"]["rounds"][last])
    row(
        "zoo-gym real processes, warm median",
        lambda r: statistics.median(r["real"]["rounds"][1:]) if rounds > 1 else None,
    )
    row(
        "zoo-gym real processes, warm min",
        lambda r: min(r["real"]["rounds"][1:]) if rounds > 1 else None,
    )
    row("Flower deployment, round 1", lambda r: r["flower"]["rounds"][0])
    row("Flower deployment, round (B)", lambda r: r["flower"]["rounds"][last])
    row("Flower ClientApp model load (mean)", lambda r: r["flower"]["client_load"])
    row("Flower ClientApp training (mean)", lambda r: r["flower"]["client_train"])
    row("Flower submit -> done (all rounds)", lambda r: r["flower"]["submit_to_done"])
    row(
        "ratio zoo-gym / Flower, round (A/B)",
        lambda r: r["real"]["rounds"][last] / r["flower"]["rounds"][last],
        "{:>14.2f}x",
    )
    row(
        "ratio zoo-gym / Flower, round 1",
        lambda r: r["real"]["rounds"][0] / r["flower"]["rounds"][0],
        "{:>14.2f}x",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[3, 10])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument(
        "--rounds", type=int, default=2, help="rounds per run; the table reports the last one"
    )
    parser.add_argument("--skip-flower", action="store_true")
    parser.add_argument("--skip-real", action="store_true", help="skip zoo-gym's real-process run")
    parser.add_argument(
        "--keep", action="store_true", help="keep the work directory (logs) and print its path"
    )
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="zoo-round-bench-"))
    results: dict[int, dict[str, Any]] = {}
    try:
        for n in args.clients:
            r: dict[str, Any] = {}
            sides: list[tuple[str, Callable[..., dict[str, Any]]]] = [("inproc", zoo_inprocess)]
            if not args.skip_real:
                sides.append(("real", zoo_real))
            if not args.skip_flower:
                sides.append(("flower", flower))
            for key, fn in sides:
                started = time.perf_counter()
                try:
                    r[key] = fn(tmp / f"{key}-{n}", n, args.steps, args.rounds)
                except Exception as exc:  # a side that fails ends the run: no table without it
                    raise SystemExit(
                        f"[{n} clients] {key} failed: {exc}; rerun with --keep for its logs"
                    ) from exc
                print(
                    f"[{n} clients] {key}: {time.perf_counter() - started:.1f} s",
                    file=sys.stderr,
                    flush=True,
                )
            results[n] = r
        skipped = frozenset(
            side for side, skip in (("real", args.skip_real), ("flower", args.skip_flower)) if skip
        )
        report(results, args.steps, args.rounds, skipped)
    finally:
        if args.keep:
            print(f"work directory: {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
