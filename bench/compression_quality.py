"""Model quality under compression: the tiny task after R federated rounds, per codec.

Run: python bench/compression_quality.py [--rounds R] [--clients N] [--a-rounds 1,4,8,16]
[--carry-codecs int8,bitdelta] [--seeds 0,1,2]. Each configuration runs the same in-process
federation (coordinator, ledger, FFA-LoRA clients, FedAvg; same seeds and data shards) with a
different client codec: none (raw float32), int8, BitDelta g128 without error feedback, and
BitDelta g128 with error feedback once per `--a-rounds` K (the frozen A stays for K rounds,
`lora_a_rounds`) and `--carry-codecs` C (the codec of the carried Bs, `carry_codec`; the
baselines carry in their own codec). Prints a Markdown table of the final validation loss (of
the last published version, the mean over `--seeds`, which vary the data shards), its ratio
to the first row, the bytes of error-feedback residual a client keeps against the float32
bytes of the update it sends, what the changes of A dropped (the norm outside the new A's row
space, relative to that round's update, mean over changes), the bytes a client uploads in the
first round of an epoch of A after the first (which also carries the residual for the
previous A, a second B per module) and in the other rounds, and their mean over an epoch.

A long command can be split into short runs: each appends its runs to `--out FILE` (JSON
lines), and ``--report FILE`` prints the table of every run in it without running anything.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from zoo_gym.client.runtime import RoundEvent
from zoo_gym.coordinator.rounds import carry_a_seed
from zoo_gym.coordinator.setup import init_home
from zoo_gym.core.synthetic import make_examples
from zoo_gym.simulation.inprocess import InProcessFederation

BASELINES = {  # label, codec, error feedback; each carries in its own codec
    "none": ("none", "none", True),
    "int8": ("int8", "int8", True),
    "noef": ("bitdelta, no EF", "bitdelta", False),
}


@dataclass(frozen=True)
class Config:
    """One row of the table."""

    label: str
    codec: str
    feedback: bool
    a_rounds: int = 1
    carry_codec: str = ""  # "" = `codec`


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
    carry_codec: str = "",
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
            f'granularity = "{granularity}"\nadapter = "{adapter}"\nlora_a_rounds = {a_rounds}\n'
            f'carry_codec = "{carry_codec or codec}"\n',
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


def _epoch_bytes(first: list[int], other: list[int], a_rounds: int) -> str:
    """Mean upload per round over an epoch of K rounds: one first round, K - 1 others."""
    if not first:
        return _mean_bytes(other)
    rest = statistics.fmean(other) if other else 0.0
    return f"{(statistics.fmean(first) + (a_rounds - 1) * rest) / a_rounds:.0f}"


def _configs(args: argparse.Namespace) -> list[Config]:
    """The rows to run: the baselines, then BitDelta + EF per K and carry codec (one carry
    codec only where K >= the rounds: no epoch after the first, nothing carried)."""
    configs = [Config(*BASELINES[name]) for name in args.baselines.split(",") if name]
    carries = [c for c in args.carry_codecs.split(",") if c]
    for k in (int(k) for k in args.a_rounds.split(",") if k):
        for carry in carries if k < args.rounds else carries[:1]:
            label = f"bitdelta + EF, K = {k}" + (f", carry {carry}" if k < args.rounds else "")
            configs.append(Config(label, "bitdelta", True, k, carry))
    return configs


def _table(rows: list[tuple[Config, list[Run]]]) -> None:
    """The Markdown table of `rows` (ratios to the first row's mean)."""
    reference = statistics.fmean(r.final for r in rows[0][1])
    print(
        "| configuration | final loss per seed | mean | vs first row | residual bytes | "
        "update bytes | dropped at a change of A | upload bytes, epoch's first round | "
        "upload bytes, other rounds | upload bytes per round over an epoch | wall s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for config, runs in rows:
        mean = statistics.fmean(r.final for r in runs)
        dropped = [d for r in runs for d in r.dropped]
        first = [b for r in runs for b in r.carry_upload]
        other = [b for r in runs for b in r.other_upload]
        print(
            f"| {config.label} | {', '.join(f'{r.final:.4f}' for r in runs)} | {mean:.4f} | "
            f"{mean / reference:.4f} | {max(r.residual_bytes for r in runs)} | "
            f"{runs[0].update_bytes} | "
            f"{f'{statistics.fmean(dropped):.1%} ({len(dropped)})' if dropped else '-'} | "
            f"{_mean_bytes(first)} | {_mean_bytes(other)} | "
            f"{_epoch_bytes(first, other, config.a_rounds)} | "
            f"{sum(r.seconds for r in runs):.0f} |"
        )


def _report(path: Path) -> None:
    """The table of every run appended to `path`, rows in the order they first appear."""
    rows: dict[Config, list[Run]] = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        rows.setdefault(Config(**record["config"]), []).append(Run(**record["run"]))
    _table(list(rows.items()))


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
    parser.add_argument(
        "--carry-codecs",
        default="int8",
        help="codec of the carried Bs of each BitDelta + EF run (comma-separated)",
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
    parser.add_argument("--out", type=Path, help="append each run to this file (JSON lines)")
    parser.add_argument("--report", type=Path, help="print the table of the runs in this file")
    args = parser.parse_args()
    if args.report is not None:
        _report(args.report)
        return
    torch.set_num_threads(1)
    seeds = [int(s) for s in args.seeds.split(",")]
    rows = []
    for config in _configs(args):
        runs = []
        for seed in seeds:
            r = run(
                config.codec,
                config.feedback,
                rounds=args.rounds,
                clients=args.clients,
                steps=args.steps,
                lr=args.lr,
                a_rounds=config.a_rounds,
                seed=seed,
                granularity=args.granularity,
                adapter=args.adapter,
                carry_codec=config.carry_codec,
            )
            print(
                f"{config.label}, seed {seed}: {r.initial:.4f} -> {r.final:.4f} in {r.seconds:.0f} s"
            )
            if args.out is not None:
                with args.out.open("a") as f:
                    f.write(json.dumps({"config": asdict(config), "run": asdict(r)}) + "\n")
            runs.append(r)
        rows.append((config, runs))
    print()
    print(
        f"{args.rounds} rounds, {args.clients} clients, {args.steps} steps, lr {args.lr}, "
        f"FedAvg, scales per {args.granularity}, {args.adapter}, seeds {args.seeds}"
    )
    print()
    _table(rows)


if __name__ == "__main__":
    main()
