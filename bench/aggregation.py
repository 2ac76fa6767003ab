"""Benchmark: zoo_gym.aggregation against Flower's own Krum, Multi-Krum, median and trimmed mean.

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

    python bench/aggregation.py --quick        # smoke run, small sizes
    python bench/aggregation.py                # n = 20, 50 x d = 1M, 10M, threads 1 and 2
    python bench/aggregation.py --full         # plus Multi-Krum over 1,000 updates of d = 1M
    python bench/aggregation.py --threads 2    # one thread count only
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
    _prepare(impl, rule, n, 4096)[0]()
    call, input_bytes = _prepare(impl, rule, n, d)
    exact = _reset_peak()
    before = _rss_kib("VmRSS") if exact else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    result = call()
    seconds = time.perf_counter() - start
    peak = _rss_kib("VmHWM") if exact else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    del result
    for _ in range(repeat - 1):
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


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="small sizes, a smoke run")
    size.add_argument("--full", action="store_true", help="also 1,000 updates of d = 1M")
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    parser.add_argument("--repeat", type=int, default=2, help="calls per measurement (min)")
    parser.add_argument("--worker", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        impl, rule, n, d, threads, repeat = args.worker
        print(json.dumps(worker(impl, rule, int(n), int(d), int(threads), int(repeat))))
        return
    sizes = (
        [(20, 100_000), (50, 100_000)]
        if args.quick
        else [(n, d) for d in (1_000_000, 10_000_000) for n in (20, 50)]
    )
    thread_counts = [int(t) for t in args.threads.split(",")]
    print(
        f"{os.cpu_count()} CPUs visible, load average {_load()} at start; f = n // 5; "
        f"Multi-Krum m = n - f; time = best of {args.repeat} calls; "
        "extra memory = peak RSS growth during the first call"
    )
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
                ours = measure("ours", rule, n, d, threads, args.repeat)
                theirs = measure("flower", rule, n, d, threads, args.repeat)
                share = ours["extra_bytes"] / ours["input_bytes"]
                their_share = theirs["extra_bytes"] / theirs["input_bytes"]
                if d >= 1_000_000:  # the target's sizes; tiny inputs show fixed overheads
                    worst_share = max(worst_share, share)
                speedup = theirs["seconds"] / ours["seconds"]
                if rule == "krum" and (n, d) == (50, 10_000_000):
                    headline[threads] = speedup
                print(
                    f"| {rule} | {n} | {d:,} | {ours['torch_threads']} | "
                    f"{_mb(ours['input_bytes'])} | {ours['seconds']:.3f} | "
                    f"{theirs['seconds']:.2f} | {speedup:.1f}x | "
                    f"{_mb(ours['extra_bytes'])} ({share:.1%}) | "
                    f"{_mb(theirs['extra_bytes'])} ({their_share:.0%}) |",
                    flush=True,
                )
    print(f"\nload average {_load()} at the end of the table")
    for threads, speedup in headline.items():
        print(
            f"Krum n = 50, d = 10M, {threads} thread(s): {speedup:.1f}x Flower "
            f"(target >= {SPEEDUP_TARGET:.0f}x: {_met(speedup >= SPEEDUP_TARGET)})"
        )
    if not args.quick:
        print(
            f"largest extra memory of ours: {worst_share:.1%} of the input "
            f"(target < {MEMORY_TARGET:.0%}: {_met(worst_share < MEMORY_TARGET)})",
            flush=True,
        )
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
