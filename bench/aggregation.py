"""Benchmark: zoo_gym.aggregation and zoo_gym.flower against Flower's own Krum, Multi-Krum,
Bulyan, median and trimmed mean.

Each measurement runs in a fresh subprocess with a fixed thread count (torch intra-op
threads and OMP/MKL/OpenBLAS threads, so NumPy's BLAS in Flower's distance matrix gets the
same). The input (n float32 updates of d values) is built first; then the peak-RSS counter
is reset (/proc/self/clear_refs, "5"), the rule runs once, and extra peak memory = VmHWM
after the call - VmRSS before it. Torch allocations are invisible to tracemalloc, so RSS is
what counts. The call is then repeated and the fastest time is kept (the machine is shared,
so single timings are noisy). Flower's side gets its input the way its strategies hold it
(one ArrayRecord per update) and runs its own functions: `select_multikrum` +
`aggregate_arrayrecords` (Krum / Multi-Krum, what `Krum` / `MultiKrum.aggregate_train`
call), `np.median` over the stacked arrays (FedMedian) and `trim_mean` (FedTrimmedAvg).

Targets: at least 15x faster than Flower's Krum at n = 50, d = 10M; our extra memory under
10% of the input everywhere; Multi-Krum over 1,000 updates of d = 1M under 8.5 s.

Two more tables, in the same run. Strategies: `aggregate_train` of zoo_gym.flower's Krum,
MultiKrum, Bulyan, Median and TrimmedMean against Flower's Krum, MultiKrum, Bulyan, FedMedian
and FedTrimmedAvg on the same n train replies (Flower Messages of full float32 weights, 8
arrays each), measured as above; the replies are built afresh before every call (Flower's
FedMedian, FedTrimmedAvg and Bulyan take the arrays out of the replies they aggregate).
Attackers: rounds of n = 11 replies, 2 of them attackers, at update scales from 1e-1 to 1e-6
of the weights: how often Flower's Krum, Multi-Krum and Bulyan selection (`select_multikrum`,
what their `aggregate_train` calls) and zoo_gym.flower's strategies select an attacker, the
attackers' share of Bulyan's aggregate, and the error of Flower's float32 distances.

    python bench/aggregation.py --quick        # smoke run, small sizes
    python bench/aggregation.py                # n = 20, 50 x d = 1M, 10M, threads 1 and 2
    python bench/aggregation.py --full         # plus Multi-Krum over 1,000 updates of d = 1M
    python bench/aggregation.py --threads 2    # one thread count only
    python bench/aggregation.py --strategies   # only the strategies' and attackers' tables
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import os
import resource
import subprocess
import sys
import time
from typing import Any

RULES = ("krum", "multikrum", "median", "trimmed_mean")
SPEEDUP_TARGET = 15.0  # x Flower's Krum at n = 50, d = 10M
MEMORY_TARGET = 0.10  # extra peak memory / input size
CLAIM_1000 = 8.5  # seconds, Multi-Krum over 1,000 contributions of d = 1M
THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> bool:
    gc.collect()
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
        return True
    except OSError:
        return False


def _f(n: int) -> int:
    return n // 5


def worker(impl: str, rule: str, n: int, d: int, threads: int, repeat: int) -> dict[str, Any]:
    """Time `rule` after a warm-up call on a small input (lazy init, thread pools)."""
    import torch

    torch.set_num_threads(threads)
    prepare = _prepare_strategy if impl.endswith("-strategy") else _prepare
    warm, _ = prepare(impl, rule, n, 4096)
    warm()
    call, input_bytes = prepare(impl, rule, n, d)
    exact = _reset_peak()
    before = _rss_kib("VmRSS") if exact else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    result = call()
    seconds = time.perf_counter() - start
    peak = _rss_kib("VmHWM") if exact else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    del result
    for _ in range(repeat - 1):
        if impl.endswith("-strategy"):  # Flower's strategies consume their replies' arrays
            call = None
            gc.collect()
            call, _ = prepare(impl, rule, n, d)
        gc.collect()
        start = time.perf_counter()
        result = call()
        seconds = min(seconds, time.perf_counter() - start)
        del result
    return {
        "seconds": seconds,
        "extra_bytes": max(0, peak - before) * 1024,
        "input_bytes": input_bytes,
        "exact_peak": exact,
        "torch_threads": torch.get_num_threads(),
    }


def _prepare(impl: str, rule: str, n: int, d: int) -> tuple[Any, int]:
    """The call to time, its input already built the way each side holds it."""
    import numpy as np
    import torch

    f = _f(n)
    m = 1 if rule == "krum" else n - f
    x: Any = torch.randn(n, d, generator=torch.Generator().manual_seed(0))  # (n, d) float32
    input_bytes = x.numel() * 4
    if impl == "ours":
        from zoo_gym.aggregation import krum, median, trimmed_mean

        calls = {
            "krum": lambda: krum(x, f=f, m=m),
            "multikrum": lambda: krum(x, f=f, m=m),
            "median": lambda: median(x),
            "trimmed_mean": lambda: trimmed_mean(x, f=f),
        }
        return calls[rule], input_bytes
    from flwr.app import Array, ArrayRecord, MetricRecord, RecordDict
    from flwr.serverapp.strategy.fedtrimmedavg import trim_mean
    from flwr.serverapp.strategy.multikrum import select_multikrum
    from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

    contents = []
    for i in range(n):
        row = x[i].numpy().copy()
        contents.append(
            RecordDict(
                {
                    "arrays": ArrayRecord({"w": Array(row)}),
                    "metrics": MetricRecord({"num-examples": 1}),
                }
            )
        )
        del row
    x = None  # only the records hold the updates now, as in Flower's strategies

    def layers() -> list[Any]:
        return [c.array_records["arrays"]["w"].numpy() for c in contents]

    flower = {
        "krum": lambda: aggregate_arrayrecords(select_multikrum(contents, f, m), "num-examples"),
        "multikrum": lambda: aggregate_arrayrecords(
            select_multikrum(contents, f, m), "num-examples"
        ),
        "median": lambda: np.median(np.stack(layers()), axis=0),
        "trimmed_mean": lambda: trim_mean(np.stack(layers()), (f + 0.5) / n),
    }
    return flower[rule], input_bytes


STRATEGIES = ("krum", "multikrum", "bulyan", "median", "trimmed_mean")
LAYERS = 8  # arrays per reply: the d values split into this many equal arrays


def replies_for(weights: Any, arrays: int = LAYERS) -> list[Any]:
    """One Flower train reply per row of `weights` (n, d) float32 NumPy, its d values split
    into `arrays` arrays, each reply with 1 example; as a ClientApp returns them."""
    import numpy as np
    from flwr.app import (
        Array,
        ArrayRecord,
        ConfigRecord,
        Message,
        MessageType,
        MetricRecord,
        RecordDict,
    )

    from zoo_gym.transport.flower_internals import set_task_identity

    set_task_identity(run_id=1, node_id=0, task_id=1)  # what Flower's runners set
    replies = []
    for i, row in enumerate(weights):
        sent = Message(
            RecordDict({"config": ConfigRecord()}),
            dst_node_id=i + 1,
            message_type=MessageType.TRAIN,
        )
        parts = {f"layer{k}.weight": Array(p) for k, p in enumerate(np.array_split(row, arrays))}
        content = RecordDict(
            {"arrays": ArrayRecord(parts), "metrics": MetricRecord({"num-examples": 1})}
        )
        replies.append(Message(content, reply_to=sent))
    return replies


def strategy_pair(rule: str, n: int, f: int) -> tuple[Any, Any]:
    """zoo_gym.flower's strategy and Flower's for `rule`, with the same f (and m = n - f)."""
    from flwr.serverapp import strategy as flwr

    from zoo_gym import flower

    if rule == "krum":
        return flower.Krum(num_malicious_nodes=f), flwr.Krum(num_malicious_nodes=f)
    if rule == "multikrum":
        return (
            flower.MultiKrum(num_malicious_nodes=f, num_nodes_to_select=n - f),
            flwr.MultiKrum(num_malicious_nodes=f, num_nodes_to_select=n - f),
        )
    if rule == "bulyan":
        return flower.Bulyan(num_malicious_nodes=f), flwr.Bulyan(num_malicious_nodes=f)
    if rule == "median":
        return flower.Median(num_malicious_nodes=f), flwr.FedMedian()
    # Flower cuts int(beta * n) from each side: beta = (f + 0.5) / n cuts exactly f
    return (
        flower.TrimmedMean(num_malicious_nodes=f),
        flwr.FedTrimmedAvg(beta=(f + 0.5) / n),
    )


def _prepare_strategy(impl: str, rule: str, n: int, d: int) -> tuple[Any, int]:
    """`aggregate_train` of zoo_gym.flower's strategy or Flower's, on n replies of full
    float32 weights (global ~ N(0, 1) plus updates ~ N(0, 0.01^2)), built before the call."""
    import torch
    from flwr.app import Array, ArrayRecord

    gen = torch.Generator().manual_seed(0)
    base = torch.randn(d, generator=gen)  # (d,)
    weights = (base + 0.01 * torch.randn(n, d, generator=gen)).numpy()  # (n, d)
    replies = replies_for(weights)
    del weights
    ours, theirs = strategy_pair(rule, n, _f(n))
    strategy = ours if impl == "ours-strategy" else theirs
    if impl == "ours-strategy":
        split = torch.tensor_split(base, LAYERS)
        ours.current_arrays = ArrayRecord(
            {f"layer{k}.weight": Array(p.numpy()) for k, p in enumerate(split)}
        )
    del base
    return (lambda: strategy.aggregate_train(1, replies)), n * d * 4


def measure(impl: str, rule: str, n: int, d: int, threads: int, repeat: int) -> dict[str, Any]:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", **{k: str(threads) for k in THREAD_ENV}}
    args = [impl, rule, str(n), str(d), str(threads), str(repeat)]
    out = subprocess.run(
        [sys.executable, __file__, "--worker", *args],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def _mb(b: float) -> str:
    return f"{b / 2**20:,.0f} MB"


def _load() -> str:
    """1-minute load average: other processes on the machine make timings noisy."""
    return f"{os.getloadavg()[0]:.1f}"


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def rules_table(sizes: list[tuple[int, int]], thread_counts: list[int], repeat: int) -> None:
    """zoo_gym.aggregation's functions against Flower's on the same (n, d) updates."""
    header = (
        "| rule | n | d | threads | input | ours s | Flower s | speed-up "
        "| ours extra mem | Flower extra mem |"
    )
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    worst_share = 0.0
    headline: dict[int, float] = {}
    for threads in thread_counts:
        for n, d in sizes:
            for rule in RULES:
                ours = measure("ours", rule, n, d, threads, repeat)
                theirs = measure("flower", rule, n, d, threads, repeat)
                share = ours["extra_bytes"] / ours["input_bytes"]
                if d >= 1_000_000:  # the target's sizes; tiny inputs show fixed overheads
                    worst_share = max(worst_share, share)
                if rule == "krum" and (n, d) == (50, 10_000_000):
                    headline[threads] = theirs["seconds"] / ours["seconds"]
                print(_row(rule, n, d, ours, theirs, f"{share:.1%}"), flush=True)
    print(f"\nload average {_load()} at the end of the table")
    for threads, speedup in headline.items():
        print(
            f"Krum n = 50, d = 10M, {threads} thread(s): {speedup:.1f}x Flower "
            f"(target >= {SPEEDUP_TARGET:.0f}x: {_met(speedup >= SPEEDUP_TARGET)})"
        )
    if any(d >= 1_000_000 for _, d in sizes):
        print(
            f"largest extra memory of ours: {worst_share:.1%} of the input "
            f"(target < {MEMORY_TARGET:.0%}: {_met(worst_share < MEMORY_TARGET)})",
            flush=True,
        )


def _row(
    rule: str, n: int, d: int, ours: dict[str, Any], theirs: dict[str, Any], share: str
) -> str:
    their_share = theirs["extra_bytes"] / theirs["input_bytes"]
    return (
        f"| {rule} | {n} | {d:,} | {ours['torch_threads']} | "
        f"{_mb(ours['input_bytes'])} | {ours['seconds']:.3f} | "
        f"{theirs['seconds']:.2f} | {theirs['seconds'] / ours['seconds']:.1f}x | "
        f"{_mb(ours['extra_bytes'])} ({share}) | "
        f"{_mb(theirs['extra_bytes'])} ({their_share:.0%}) |"
    )


def strategies_table(sizes: list[tuple[int, int]], thread_counts: list[int], repeat: int) -> None:
    """`aggregate_train` of zoo_gym.flower's strategies against Flower's on the same replies."""
    print(
        f"\nStrategies' aggregate_train on n replies of full float32 weights ({LAYERS} arrays "
        f"each); load average {_load()} at start"
    )
    header = (
        "| strategy | n | d | threads | replies | zoo_gym.flower s | Flower s | speed-up "
        "| zoo_gym.flower extra mem | Flower extra mem |"
    )
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for threads in thread_counts:
        for n, d in sizes:
            for rule in STRATEGIES:
                ours = measure("ours-strategy", rule, n, d, threads, repeat)
                theirs = measure("flower-strategy", rule, n, d, threads, repeat)
                share = ours["extra_bytes"] / ours["input_bytes"]
                print(_row(rule, n, d, ours, theirs, f"{share:.0%}"), flush=True)
    print(f"\nload average {_load()} at the end of the table")


ATTACK_SCALES = (1e-1, 1e-2, 1e-3, 1e-4, 1e-5, 1e-6)  # update RMS / weight RMS


def attack_round(seed: int, n: int, f: int, d: int, scale: float) -> tuple[Any, Any, list[int]]:
    """Global weights ~ N(0, 1) `(d,)` float32 and n replies `(n, d)` float32: n - f honest
    updates scale * (g + 0.5 noise) around a common direction g, f attackers at random places
    sending scale * (-3 g + 0.5 noise): the honest direction flipped and tripled, with the
    honest spread."""
    import numpy as np

    rng = np.random.default_rng(seed)
    base = rng.standard_normal(d).astype(np.float32)
    g = rng.standard_normal(d)
    updates = scale * (g + 0.5 * rng.standard_normal((n, d)))
    attackers = sorted(int(i) for i in rng.choice(n, size=f, replace=False))
    updates[attackers] = scale * (-3.0 * g + 0.5 * rng.standard_normal((f, d)))
    return base, (base + updates).astype(np.float32), attackers


def _flower_bulyan_share(weights: Any, chosen: list[int], attackers: list[int], f: int) -> float:
    """The attackers' share of the entries Flower's Bulyan averages: per coordinate, the
    beta = theta - 2f selected values closest to their median (`aggregate_n_closest_weights`)."""
    import numpy as np

    stack = weights[chosen]  # (theta, d)
    beta = len(chosen) - 2 * f
    diffs = np.abs(stack - np.median(stack, axis=0))
    idx = np.argpartition(diffs, beta - 1, axis=0)[:beta]  # (beta, d) rows into `chosen`
    bad = np.isin(np.asarray(chosen)[idx], attackers)
    return float(bad.mean())


def _attack_trial(seed: int, n: int, f: int, d: int, scale: float) -> dict[str, Any]:
    """What Flower's Krum, Multi-Krum and Bulyan and zoo_gym.flower's choose in one round."""
    import numpy as np
    from flwr.app import Array, ArrayRecord
    from flwr.serverapp.strategy.multikrum import compute_distances, select_multikrum

    from zoo_gym import flower

    base, weights, attackers = attack_round(seed, n, f, d, scale)
    contents = [r.content for r in replies_for(weights, arrays=1)]
    out: dict[str, Any] = {}
    for name, m in (("krum", 1), ("multikrum", n - f), ("bulyan", n - 2 * f)):
        picked = select_multikrum(contents, num_malicious_nodes=f, num_nodes_to_select=m)
        chosen = [i for i, c in enumerate(contents) if any(c is p for p in picked)]
        out["flower " + name] = bool(set(chosen) & set(attackers))
    out["flower share"] = _flower_bulyan_share(weights, chosen, attackers, f)
    for make in (flower.Krum, flower.MultiKrum, flower.Bulyan):
        strategy = make(num_malicious_nodes=f)
        strategy.current_arrays = ArrayRecord({"layer0.weight": Array(base)})
        strategy.aggregate_train(1, replies_for(weights, arrays=1))
        decisions = [dec for _, dec in strategy.last_decisions]
        taken = [dec.selected for dec in decisions]
        if make is flower.Bulyan:  # its first step: the theta chosen by recursive Krum
            taken = [not dec.reason.startswith("not among") for dec in decisions]
        out["ours " + make.__name__.lower()] = any(taken[i] for i in attackers)
    out["ours share"] = sum(decisions[i].weight for i in attackers)
    theirs = compute_distances([c.array_records["arrays"] for c in contents])
    x = weights.astype(np.float64) - base.astype(np.float64)  # the float32 updates, exactly
    exact = ((x[:, None, :] - x[None, :, :]) ** 2).sum(axis=2)
    honest = [i for i in range(n) if i not in attackers]
    pairs = [(i, j) for i in honest for j in honest if i < j]
    out["error"] = float(
        np.median([abs(theirs[i, j] - exact[i, j]) / exact[i, j] for i, j in pairs])
    )
    return out


def attack_table(n: int, d: int, trials: int) -> None:
    """How often an attacker is selected by Flower's Krum, Multi-Krum (m = n - f) and Bulyan
    (theta = n - 2f chosen) and by zoo_gym.flower's, and the attackers' share of Bulyan's
    aggregate, as the updates shrink next to the weights."""
    import numpy as np

    f = 2
    print(
        f"\nAttackers selected: n = {n} replies, f = {f} sending -3x the honest direction with "
        f"the honest spread, d = {d:,}, {trials} rounds per scale (seeds 0..{trials - 1}); "
        f"load average {_load()}"
    )
    print(
        "| update RMS / weight RMS | Flower's distance error | Krum: Flower | zoo_gym.flower "
        "| Multi-Krum: Flower | zoo_gym.flower | Bulyan's theta: Flower | zoo_gym.flower "
        "| attackers' share of Bulyan: Flower | zoo_gym.flower |"
    )
    print("|" + "---|" * 10)
    for scale in ATTACK_SCALES:
        results = [_attack_trial(seed, n, f, d, scale) for seed in range(trials)]
        error = float(np.median([r["error"] for r in results]))
        cells = [
            f"{sum(r[side + ' ' + k] for r in results)}/{trials}"
            for k in ("krum", "multikrum", "bulyan")
            for side in ("flower", "ours")
        ]
        cells += [
            f"{np.mean([r[side + ' share'] for r in results]):.1%}" for side in ("flower", "ours")
        ]
        print(f"| {scale:.0e} | {error:.1e} | " + " | ".join(cells) + " |", flush=True)
    print(f"\nload average {_load()} at the end of the table")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="small sizes, a smoke run")
    size.add_argument("--full", action="store_true", help="also 1,000 updates of d = 1M")
    parser.add_argument(
        "--strategies", action="store_true", help="only the strategies' and attacker tables"
    )
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    parser.add_argument("--repeat", type=int, default=2, help="calls per measurement (min)")
    parser.add_argument("--worker", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        impl, rule, n, d, threads, repeat = args.worker
        print(json.dumps(worker(impl, rule, int(n), int(d), int(threads), int(repeat))))
        return
    small = [(20, 100_000), (50, 100_000)]
    sizes = small if args.quick else [(n, d) for d in (1_000_000, 10_000_000) for n in (20, 50)]
    thread_counts = [int(t) for t in args.threads.split(",")]
    print(
        f"{os.cpu_count()} CPUs visible, load average {_load()} at start; f = n // 5; "
        f"Multi-Krum m = n - f; time = best of {args.repeat} calls; "
        "extra memory = peak RSS growth during the first call"
    )
    if not args.strategies:
        rules_table(sizes, thread_counts, args.repeat)
    strategy_sizes = small if args.quick else [(20, 1_000_000), (50, 1_000_000)]
    strategies_table(strategy_sizes, thread_counts, args.repeat)
    attack_table(11, 10_000 if args.quick else 100_000, 5 if args.quick else 20)
    if args.full:
        for threads in thread_counts:
            big = measure("ours", "multikrum", 1000, 1_000_000, threads, 1)
            share = big["extra_bytes"] / big["input_bytes"]
            print(
                f"Multi-Krum, 1,000 updates x d = 1M ({_mb(big['input_bytes'])}), "
                f"{big['torch_threads']} thread(s): {big['seconds']:.2f} s "
                f"(target < {CLAIM_1000} s: {_met(big['seconds'] < CLAIM_1000)}), extra memory "
                f"{_mb(big['extra_bytes'])} ({share:.1%} of input); load average {_load()}",
                flush=True,
            )


if __name__ == "__main__":
    main()
