"""Model quality under compression: the tiny task after R federated rounds, per codec.

Run: python bench/compression_quality.py [--rounds R] [--clients N] [--a-rounds 1,4,8,16]
[--seeds 0,1,2]. Each configuration runs the same in-process federation (coordinator, ledger,
FFA-LoRA clients, FedAvg; same seeds and data shards) with a different client codec: none
(raw float32), int8, BitDelta g128 without error feedback, and BitDelta g128 with error
feedback once per `--a-rounds` K (the frozen A stays for K rounds, `lora_a_rounds`). Prints a
Markdown table of the final validation loss (of the last published version, the mean over
`--seeds`, which vary the data shards), its ratio to the uncompressed run, the bytes of
error-feedback residual a client keeps against the float32 bytes of the update it sends,
what the changes of A dropped (the norm outside the new A's row space, relative to that
round's update, mean over changes), and the bytes a client uploads in the first round of an
epoch of A after the first (which also carries the residual for the previous A, a second B per
module) against the other rounds.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from zoo_gym.client.runtime import RoundEvent
from zoo_gym.coordinator.rounds import carry_a_seed
from zoo_gym.coordinator.setup import init_home
from zoo_gym.core.synthetic import make_examples
from zoo_gym.simulation.inprocess import InProcessFederation

BASELINES = {
    "none": ("none", "none", True),
    "int8": ("int8", "int8", True),
    "noef": ("bitdelta, no EF", "bitdelta", False),
}


@dataclass
class Run:
    """One federation: losses, wall time and what the clients reported per round."""

    initial: float
    final: float
    seconds: float
    residual_bytes: int = 0  # largest residual a client kept
    update_bytes: int = 0  # float32 bytes of one update
    dropped: list[float] = field(default_factory=list)  # dropped / update, per change of A
    carry_upload: list[int] = field(default_factory=list)  # payload bytes, epoch's first rounds
    other_upload: list[int] = field(default_factory=list)  # payload bytes, the other rounds


def run(
    codec: str,
    feedback: bool,
    *,
    rounds: int,
    clients: int,
    steps: int,
    lr: float,
    a_rounds: int = 1,
    seed: int = 0,
    granularity: str = "group",
    adapter: str = "ffa_lora",
) -> Run:
    """One federation; `seed` picks the data shards (0: the shards of earlier tables)."""
    torch.manual_seed(seed)
    events: list[RoundEvent] = []
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp) / "coordinator"
        init_home(
            home,
            tiny=True,
            settings=f'rounds = {rounds}\nmin_clients = {clients}\naggregator = "fedavg"\n',
            training=f'steps = {steps}\nlearning_rate = {lr}\ncodec = "{codec}"\ngroup_size = 128\n'
            f'granularity = "{granularity}"\nadapter = "{adapter}"\nlora_a_rounds = {a_rounds}\n',
        )
        shards = [make_examples(60, seed=100 + i + 1000 * seed) for i in range(clients)]
        federation = InProcessFederation.build(home, shards, seed=seed)
        for runtime in federation.runtimes.values():
            runtime.feedback.enabled = feedback
            runtime.on_event = events.append
        start = time.perf_counter()
        summaries = federation.run()
        seconds = time.perf_counter() - start
    final = summaries[0].loss_before
    for summary in summaries:
        if summary.status == "published":
            final = summary.loss_after
    result = Run(summaries[0].loss_before, final, seconds)
    for event in events:
        if event.kind == "compressed":
            d = event.detail
            result.residual_bytes = max(result.residual_bytes, int(d.get("residual_bytes", 0)))
            result.update_bytes = int(d.get("update_bytes", 0))
            if "dropped_share" in d:
                result.dropped.append(float(d["dropped_share"]))
            carries = adapter == "ffa_lora" and carry_a_seed(0, event.round, a_rounds) is not None
            upload = result.carry_upload if carries else result.other_upload
            upload.append(int(d.get("payload_bytes", 0)))
    return result


def _mean_bytes(values: list[int]) -> str:
    return f"{statistics.fmean(values):.0f}" if values else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20, help="local steps per round")
    parser.add_argument("--lr", type=float, default=0.005)
    parser.add_argument(
        "--baselines", default="none,int8,noef", help="of none, int8, noef (comma-separated)"
    )
    parser.add_argument(
        "--a-rounds", default="1", help="K of each BitDelta + EF run (comma-separated)"
    )
    parser.add_argument("--seeds", default="0", help="data seeds, averaged (comma-separated)")
    parser.add_argument(
        "--adapter",
        default="ffa_lora",
        choices=("ffa_lora", "lora", "dora", "full"),
        help="what trains",
    )
    parser.add_argument(
        "--granularity", default="group", choices=("group", "row", "matrix"), help="scale per ..."
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    configs = [BASELINES[name] + (1,) for name in args.baselines.split(",") if name]
    configs += [
        (f"bitdelta + EF, K = {k}", "bitdelta", True, k)
        for k in (int(k) for k in args.a_rounds.split(",") if k)
    ]
    seeds = [int(s) for s in args.seeds.split(",")]
    rows = []
    for label, codec, feedback, a_rounds in configs:
        runs = []
        for seed in seeds:
            r = run(
                codec,
                feedback,
                rounds=args.rounds,
                clients=args.clients,
                steps=args.steps,
                lr=args.lr,
                a_rounds=a_rounds,
                seed=seed,
                granularity=args.granularity,
                adapter=args.adapter,
            )
            print(f"{label}, seed {seed}: {r.initial:.4f} -> {r.final:.4f} in {r.seconds:.0f} s")
            runs.append(r)
        rows.append((label, runs))
    reference = statistics.fmean(r.final for r in rows[0][1])
    print()
    print(
        f"{args.rounds} rounds, {args.clients} clients, {args.steps} steps, lr {args.lr}, "
        f"FedAvg, scales per {args.granularity}, {args.adapter}, seeds {args.seeds}"
    )
    print()
    print(
        "| configuration | final loss per seed | mean | vs first row | residual bytes | "
        "update bytes | dropped at a change of A | upload bytes, epoch's first round | "
        "upload bytes, other rounds | wall s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for label, runs in rows:
        mean = statistics.fmean(r.final for r in runs)
        dropped = [d for r in runs for d in r.dropped]
        print(
            f"| {label} | {', '.join(f'{r.final:.4f}' for r in runs)} | {mean:.4f} | "
            f"{mean / reference:.4f} | {max(r.residual_bytes for r in runs)} | "
            f"{runs[0].update_bytes} | "
            f"{f'{statistics.fmean(dropped):.1%} ({len(dropped)})' if dropped else '-'} | "
            f"{_mean_bytes([b for r in runs for b in r.carry_upload])} | "
            f"{_mean_bytes([b for r in runs for b in r.other_upload])} | "
            f"{sum(r.seconds for r in runs):.0f} |"
        )


if __name__ == "__main__":
    main()
