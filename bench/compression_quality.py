"""Model quality under compression: the tiny task after R federated rounds, per codec.

Run: python bench/compression_quality.py [--rounds R] [--clients N]. Each configuration runs
the same in-process federation (coordinator, ledger, FFA-LoRA clients, FedAvg; same seeds and
data shards) with a different client codec: none (raw float32), int8, BitDelta g128 with
error feedback, and BitDelta g128 without it. Prints a Markdown table of the final
validation loss (of the last published version) and its ratio to the uncompressed run.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from zoo_gym.coordinator.setup import init_home
from zoo_gym.core.synthetic import make_examples
from zoo_gym.simulation.inprocess import InProcessFederation

CONFIGS = (
    ("none", "none", True),
    ("int8", "int8", True),
    ("bitdelta + EF", "bitdelta", True),
    ("bitdelta, no EF", "bitdelta", False),
)


def run(
    codec: str,
    feedback: bool,
    *,
    rounds: int,
    clients: int,
    steps: int,
    lr: float,
    granularity: str = "group",
    adapter: str = "ffa_lora",
) -> tuple[float, float, float]:
    """(initial loss, final loss, seconds) of one federation."""
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp) / "coordinator"
        init_home(
            home,
            tiny=True,
            settings=f'rounds = {rounds}\nmin_clients = {clients}\naggregator = "fedavg"\n',
            training=f'steps = {steps}\nlearning_rate = {lr}\ncodec = "{codec}"\ngroup_size = 128\n'
            f'granularity = "{granularity}"\nadapter = "{adapter}"\n',
        )
        shards = [make_examples(60, seed=100 + i) for i in range(clients)]
        federation = InProcessFederation.build(home, shards, seed=0)
        for runtime in federation.runtimes.values():
            runtime.feedback.enabled = feedback
        start = time.perf_counter()
        summaries = federation.run()
        seconds = time.perf_counter() - start
    final = summaries[0].loss_before
    for summary in summaries:
        if summary.status == "published":
            final = summary.loss_after
    return summaries[0].loss_before, final, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20, help="local steps per round")
    parser.add_argument("--lr", type=float, default=0.005)
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
    rows = []
    for label, codec, feedback in CONFIGS:
        initial, final, seconds = run(
            codec,
            feedback,
            rounds=args.rounds,
            clients=args.clients,
            steps=args.steps,
            lr=args.lr,
            granularity=args.granularity,
            adapter=args.adapter,
        )
        rows.append((label, initial, final, seconds))
        print(f"{label}: {initial:.4f} -> {final:.4f} in {seconds:.0f} s", flush=True)
    reference = rows[0][2]
    print()
    print(
        f"{args.rounds} rounds, {args.clients} clients, {args.steps} steps, lr {args.lr}, "
        f"FedAvg, scales per {args.granularity}, {args.adapter}"
    )
    print()
    print("| codec | initial loss | final loss | vs none |")
    print("|---|---|---|---|")
    for label, initial, final, _ in rows:
        print(f"| {label} | {initial:.4f} | {final:.4f} | {final / reference:.4f} |")


if __name__ == "__main__":
    main()
