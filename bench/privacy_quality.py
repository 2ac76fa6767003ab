"""Benchmark: model quality under sample-level DP-SGD, against FFA-LoRA without DP.

A whole federation runs in-process (the deployment coordinator, intake, ledger and
ClientApps on the loopback Grid) on the tiny synthetic task, for R rounds, three ways:
FFA-LoRA without DP (the anchor), and DP-SGD at a per-round target epsilon of 8 and of 1,
where every client picks its own sigma for its sample rate (batch_size / its records) with
the task's accountant. Reported: validation loss before round 1 and after round R, the share
of the anchor's improvement kept, the sigma the clients picked, the per-round epsilon, and
each client's total over R rounds (accountant composition, and the naive sum for contrast).

The quality gate is off (every aggregate is published) so the loss shows what training did.

    python bench/privacy_quality.py                   # 3 clients x 60 records, 5 rounds of 20 steps
    python bench/privacy_quality.py --rounds 2 --steps 8   # quick
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

SETTINGS: list[tuple[str, dict[str, Any]]] = [
    ("FFA-LoRA, no DP", {}),
    ("DP-SGD, epsilon 8 / round", {"dp_target_epsilon": 8.0}),
    ("DP-SGD, epsilon 1 / round", {"dp_target_epsilon": 1.0}),
]


def run_setting(
    template: Path, workdir: Path, dp: dict[str, Any], args: argparse.Namespace
) -> dict[str, Any]:
    from zoo_gym.core.synthetic import make_examples, shard
    from zoo_gym.simulation.inprocess import InProcessFederation

    home = workdir / "coordinator"
    shutil.copytree(template, home)
    training = {
        "steps": args.steps,
        "batch_size": args.batch_size,
        "learning_rate": args.lr,
        "dp_delta": args.delta,
        "dp_max_grad_norm": 1.0,
        **dp,
    }
    overrides = {
        "rounds": args.rounds,
        "min_clients": args.clients,
        "aggregator": "fedavg",
        "quality_gate_tolerance": 1e9,
        "training": training,
    }
    shards = shard(make_examples(args.clients * args.records, seed=11), args.clients)
    fed = InProcessFederation.build(home, shards, overrides=overrides)
    started = time.perf_counter()
    summaries = fed.run()
    seconds = time.perf_counter() - started
    spends = [rt.state.privacy for rt in fed.runtimes.values()]
    sigmas = [r.dp_noise_multiplier for a in spends for r in a.rounds]
    per_round = [r.epsilon for a in spends for r in a.rounds if r.epsilon is not None]
    totals = [a.total(args.delta) for a in spends]
    return {
        "loss_before": summaries[0].loss_before,
        "loss_after": summaries[-1].loss_after,
        "published": sum(s.status == "published" for s in summaries),
        "sigma": statistics.mean(sigmas) if sigmas and max(sigmas) > 0 else 0.0,
        "epsilon_round": max(per_round) if per_round else None,
        "epsilon_total": max(t for t in totals if t is not None)
        if all(t is not None for t in totals)
        else None,
        "naive_sum": max(a.naive_epsilon_sum for a in spends),
        "seconds": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--records", type=int, default=60, help="records per client")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--delta", type=float, default=1e-5)
    args = parser.parse_args()

    import torch

    from zoo_gym.cli.common import quiet_libraries
    from zoo_gym.coordinator.setup import init_home

    torch.set_num_threads(1)
    quiet_libraries()
    with tempfile.TemporaryDirectory() as tmp:
        template = Path(tmp) / "template"
        init_home(template, tiny=True, settings="")
        rows = []
        for i, (name, dp) in enumerate(SETTINGS):
            rows.append((name, run_setting(template, Path(tmp) / f"run{i}", dp, args)))
            print(f"done: {name} ({rows[-1][1]['seconds']:.0f} s)", flush=True)

    anchor = rows[0][1]
    gain = anchor["loss_before"] - anchor["loss_after"]
    q = min(1.0, args.batch_size / args.records)
    print(
        f"\n{args.clients} clients x {args.records} records, {args.rounds} rounds x {args.steps} steps, "
        f"batch {args.batch_size} (q = {q:g}), lr {args.lr:g}, delta {args.delta:g}, RDP accountant\n"
    )
    print(
        "| setting | sigma | eps / round | eps total (RDP) | naive sum | val loss before | after | "
        "improvement kept | published |"
    )
    print("|---|---|---|---|---|---|---|---|---|")

    def eps(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}"

    for name, r in rows:
        kept = (r["loss_before"] - r["loss_after"]) / gain if gain > 0 else float("nan")
        print(
            f"| {name} | {r['sigma']:.3f} | {eps(r['epsilon_round'])} | {eps(r['epsilon_total'])} | "
            f"{eps(r['naive_sum'] if r['epsilon_round'] is not None else None)} | {r['loss_before']:.4f} | "
            f"{r['loss_after']:.4f} | {kept:.2f}x | {r['published']}/{args.rounds} |"
        )


if __name__ == "__main__":
    main()
