"""Benchmark: contributor-rounds per second of `gym-sim`'s batched engine against Flower's own
simulation engine and against the per-contributor in-process engine, in one run.

Every side federates the same virtual contributors on the tiny Qwen2 and the synthetic addition
task (the sweep's shards: `examples_per_client` records each), FFA-LoRA rank 8 on the default
targets, `--steps` AdamW steps of batch 8, lr 0.01, max length 96, seed 0:

- batched: `zoo_gym.simulation.batched.BatchedFederation`, the coordinator's round loop (intake,
  ledger, FedAvg, merge, validation, publish) over contributors that train together on one
  shared model, two training threads;
- inprocess: `zoo_gym.simulation.inprocess.InProcessFederation`, the same round loop over one
  ClientApp, model and copy of each version per contributor;
- flower (anchor): `flwr.simulation.run_simulation` on Ray (node 127.0.0.1, no dashboard, two
  CPUs, one per ClientApp), a ServerApp running `flwr.serverapp.strategy.FedAvg` of the float32
  B matrices (the train message carries the published base, every weight; central evaluation
  merges the mean B and computes the same validation loss), and a ClientApp that loads that
  base and trains with the client's own `FfaLoraTrainer` on its shard (the model is built once
  per Ray worker and kept, as a Flower user would).

The tiny model and its validation split are built once; each side runs in its own process on a copy
(Flower's in a user and network namespace that has only the loopback where the machine allows one,
as tests/netns.py runs the Ray tests); the parent samples the resident memory of that process and
all its descendants (Ray's raylet, GCS and workers included) every 0.1 s. A round's seconds run
from its task to its validation loss (zoo-gym: `RoundSummary.seconds`; Flower: between the
ServerApp's `evaluate_fn` calls). The rate is contributors x rounds / seconds over the rounds after
the first (warm: Ray's workers and the per-contributor models are up), the first round and the
setup (federation built, keys registered, records tokenised) are reported beside. "Sent" is one
contributor's upload per round: the BitDelta envelope for zoo-gym, the float32 ArrayRecord for
Flower.

    python bench/simulation.py                         # 100 contributors x 3 rounds, all sides
    python bench/simulation.py --clients 1000 --sides batched --rounds 1
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parent.parent
SIDES = ("batched", "inprocess", "flower")


def sweep(args: argparse.Namespace) -> Any:
    from zoo_gym.simulation.sweep import SweepConfig

    return SweepConfig(
        aggregators=["fedavg"],
        attacks=["sign_flip"],
        byzantine_shares=[0.1],
        clients=args.clients,
        rounds=args.rounds,
        warmup_rounds=0,
        steps=args.steps,
        f=0,
        engine="batched" if args.side == "batched" else "inprocess",
    )


def run_zoo(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """One federation of the batched or in-process engine: setup and round seconds."""
    from zoo_gym.compression import CodecSpec, encode
    from zoo_gym.simulation.batched import BatchedFederation
    from zoo_gym.simulation.inprocess import InProcessFederation
    from zoo_gym.simulation.sweep import Cell, cell_overrides, shards_for

    config = sweep(args)
    started = time.perf_counter()
    home = work / "cell"
    shutil.copytree(args.template, home)
    federation = BatchedFederation if args.side == "batched" else InProcessFederation
    fed = federation.build(
        home, shards_for(config), overrides=cell_overrides(config, Cell("fedavg", "none", 0.0))
    )
    built = time.perf_counter()
    summaries = fed.run()
    done = time.perf_counter()
    zeros = _zero_update(home / "base")
    return {
        "setup_s": built - started,
        "rounds_s": done - built,
        "round_s": [s.seconds for s in summaries],
        "published": sum(s.status == "published" for s in summaries),
        "loss": summaries[-1].loss_after,
        "sent_bytes": len(encode(zeros, CodecSpec(codec=config.codec))),
    }


def _zero_update(model_dir: Path) -> dict[str, Any]:
    """A B-shaped update of the tiny model (what one contributor sends)."""
    import torch

    from zoo_gym.coordinator.rounds import update_layout
    from zoo_gym.core.lora import LoraSpec
    from zoo_gym.core.weights import load_weights

    layout = update_layout(load_weights(model_dir), LoraSpec())
    return {s.name: torch.full(s.shape, 1e-3) for s in layout}


def run_flower(args: argparse.Namespace) -> dict[str, Any]:
    """The same contributors on `flwr.simulation.run_simulation` (Ray)."""
    from flwr.simulation import run_simulation

    from zoo_gym.simulation.ray_engine import ray_backend_config

    started = time.perf_counter()
    home = args.template
    marks: dict[str, Any] = {"ends": []}
    server, client = flower_apps(args, home, marks)
    run_simulation(
        server, client, num_supernodes=args.clients, backend_config=ray_backend_config(2)
    )
    ends = marks["ends"]  # after the base's evaluation, then after each round's
    return {
        "setup_s": marks["start"] - started,
        "rounds_s": marks["end"] - marks["start"],
        "round_s": [b - a for a, b in itertools.pairwise(ends)],
        "published": args.rounds,
        "loss": marks["loss"],
        "sent_bytes": sum(t.numel() * 4 for t in _zero_update(home / "base").values()),
    }


def flower_apps(args: argparse.Namespace, home: Path, marks: dict[str, Any]) -> tuple[Any, Any]:
    """A ServerApp (FedAvg of the Bs, central evaluation) and a ClientApp (FfaLoraTrainer)."""
    import torch
    from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg

    from zoo_gym.coordinator.evaluation import Evaluator
    from zoo_gym.coordinator.rounds import round_seed, update_layout
    from zoo_gym.core.lora import LoraSpec, merge_ffa
    from zoo_gym.core.weights import load_weights
    from zoo_gym.simulation.sweep import shards_for

    config, model_dir, steps, rounds = sweep(args), home / "base", args.steps, args.rounds
    seed = round_seed(0, 1)  # one A for the run (the zoo-gym sides keep A for 8 rounds)
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        torch.set_num_threads(1)
        base = [load_weights(model_dir)]  # the published versions, newest last
        zeros = {s.name: torch.zeros(s.shape) for s in update_layout(base[0], LoraSpec())}
        evaluator = Evaluator(model_dir, home / "validation.jsonl", max_length=96)

        def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
            if server_round > 0:  # a new dict: the evaluator keeps what it loaded last
                merged = {k: v.clone() for k, v in base[-1].items()}
                merge_ffa(merged, arrays.to_torch_state_dict(), spec=LoraSpec(), seed=seed)
                base.append(merged)
            marks["loss"] = evaluator.loss(base[-1])
            marks["ends"].append(time.perf_counter())
            return MetricRecord({"loss": marks["loss"]})

        class BaseFedAvg(FedAvg):
            """FedAvg of the Bs that sends each round the published base (FFA-LoRA clients
            train B from zero on it; what FedAvg would send, the last mean B, they ignore)."""

            def configure_train(  # type: ignore[no-untyped-def]
                self, server_round, arrays, config, grid
            ):
                published = ArrayRecord(torch_state_dict=base[-1])
                return super().configure_train(server_round, published, config, grid)

        strategy = BaseFedAvg(
            fraction_train=1.0,
            fraction_evaluate=0.0,
            min_train_nodes=args.clients,
            min_available_nodes=args.clients,
        )
        marks["start"] = time.perf_counter()
        strategy.start(  # the clients start B at zero every round (FFA-LoRA), whatever is sent
            grid=grid,
            initial_arrays=ArrayRecord(torch_state_dict=zeros),
            num_rounds=rounds,
            train_config=ConfigRecord({"seed": seed}),
            evaluate_fn=evaluate,
        )
        marks["end"] = time.perf_counter()

    client = ClientApp()
    kept: dict[str, Any] = {}  # per Ray worker: the trainer and the shards

    @client.train()
    def train(msg: Message, context: Context) -> Message:
        torch.set_num_threads(1)
        from transformers import AutoTokenizer

        from zoo_gym.client.trainers.adapters import load_base_model
        from zoo_gym.client.trainers.sft import FfaLoraTrainer
        from zoo_gym.core.chat import to_conversation

        if not kept:
            model = load_base_model(model_dir, adapter="ffa_lora", device="cpu", max_full_params=0)
            tokenizer = AutoTokenizer.from_pretrained(model_dir)
            kept["trainer"] = FfaLoraTrainer(model, tokenizer, spec=LoraSpec())
            kept["shards"] = shards_for(config)
        partition = int(context.node_config["partition-id"])
        kept["trainer"].load_base(msg.content["arrays"].to_torch_state_dict())
        result = kept["trainer"].train_round(
            [to_conversation(r) for r in kept["shards"][partition]],
            seed=int(msg.content["config"]["seed"]),
            steps=steps,
            lr=config.learning_rate,
            batch_size=config.batch_size,
            max_length=96,
        )
        arrays = ArrayRecord(torch_state_dict={k: v.contiguous() for k, v in result.update.items()})
        metrics = MetricRecord(
            {"num-examples": result.num_examples, "train_loss": result.mean_loss}
        )
        return Message(RecordDict({"arrays": arrays, "metrics": metrics}), reply_to=msg)

    return server, client


def child(args: argparse.Namespace) -> None:
    """Run one side in this process and print its JSON line."""
    with tempfile.TemporaryDirectory(prefix=f"zoo-bench-sim-{args.side}-") as tmp:
        out = run_flower(args) if args.side == "flower" else run_zoo(args, Path(tmp))
    print("RESULT " + json.dumps(out), flush=True)


def tree_rss(pid: int) -> int:
    """Resident bytes of process `pid` and all its descendants."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            total += p.memory_info().rss
    return total


def loopback_only(command: list[str]) -> list[str]:
    """`command` in a user and network namespace whose only interface is the loopback, as
    tests/netns.py runs the Ray tests (Ray 2.55 binds its servers to every interface); as it
    is where unprivileged namespaces are not allowed, with a warning."""
    unshare = shutil.which("unshare")
    probe = [unshare, "--user", "--map-root-user", "--net", "true"] if unshare else None
    if probe is None or subprocess.run(probe, capture_output=True).returncode != 0:
        print("no unprivileged network namespace here: Ray's servers listen on every interface")
        return command
    up = "ip link set lo up" if shutil.which("ip") else "true"
    return [
        unshare,
        "--user",
        "--map-root-user",
        "--net",
        "sh",
        "-c",
        f'{up} && exec "$@"',
        "sh",
        *command,
    ]


def measure(side: str, args: argparse.Namespace) -> dict[str, Any]:
    """Run `side` in a child process; its result and the peak RSS of its process tree."""
    command = [sys.executable, __file__, "--child", "--side", side]
    command += ["--clients", str(args.clients), "--rounds", str(args.rounds)]
    command += ["--steps", str(args.steps), "--template", str(args.template)]
    if side == "flower":
        command = loopback_only(command)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    peak = 0
    stop = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, tree_rss(proc.pid))
            time.sleep(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    stdout, _ = proc.communicate()
    stop.set()
    sampler.join()
    lines = [line for line in stdout.decode().splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{side} failed (exit {proc.returncode}); run it alone with --child")
    return {**json.loads(lines[-1].removeprefix("RESULT ")), "peak_rss": peak}


def report(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    """The table: first round (setup and loading included for nobody: setup is its own column),
    then the warm rounds after it, and the batched engine's rate over each side's."""
    warm = args.rounds - 1
    print(f"{args.clients} contributors x {args.rounds} rounds, {args.steps} steps of batch 8")
    print(
        "| engine | setup s | round 1 s | warm round s | contributor-rounds/s (warm) "
        "| batched / this | peak RSS MB | sent per contributor-round | peak RSS / one round sent |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")

    def rate(r: dict[str, Any]) -> float:
        rounds = r["round_s"][1:] if warm else r["round_s"]
        return args.clients * len(rounds) / sum(rounds)

    fast = results.get("batched")
    for side, r in results.items():
        later = r["round_s"][1:]
        warm_s = f"{sum(later) / len(later):.2f}" if later else "-"
        ratio = f"{rate(fast) / rate(r):.1f}x" if fast else "-"
        sent = r["sent_bytes"] * args.clients
        print(
            f"| {side} | {r['setup_s']:.1f} | {r['round_s'][0]:.2f} | {warm_s} | {rate(r):.1f} "
            f"| {ratio} | {r['peak_rss'] / 2**20:.0f} | {r['sent_bytes'] / 1024:.1f} KB "
            f"| {r['peak_rss'] / sent:.0f}x |"
        )
    losses = ", ".join(f"{side} {r['loss']:.4f}" for side, r in results.items())
    print(f"validation loss after the last round: {losses}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument(
        "--sides", default=",".join(SIDES), help="comma-separated: " + ", ".join(SIDES)
    )
    parser.add_argument("--side", choices=SIDES, default="batched", help=argparse.SUPPRESS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--template", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    unknown = [s for s in sides if s not in SIDES]
    if unknown:
        raise SystemExit(f"unknown side {unknown[0]!r}; choose from {', '.join(SIDES)}")
    from zoo_gym.coordinator.setup import init_home

    with tempfile.TemporaryDirectory(prefix="zoo-bench-sim-") as tmp:
        args.template = Path(tmp) / "home"  # the tiny model, tokenizer and validation split
        init_home(args.template, tiny=True, settings="", seed=0)
        results = {side: measure(side, args) for side in sides}
    report(results, args)


if __name__ == "__main__":
    main()
