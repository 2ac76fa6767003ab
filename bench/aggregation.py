"""Benchmark: zoo_gym.aggregation against Flower's own Krum, Multi-Krum, median and trimmed mean.

Each measurement runs in a fresh subprocess. The input (n float32 updates of d values) is
built first; then the peak-RSS counter is reset (/proc/self/clear_refs, "5"), the rule runs
once, and extra peak memory = VmHWM after the call - VmRSS before it. Torch allocations are
invisible to tracemalloc, so RSS is what counts. Flower's side gets its input the way its
strategies hold it (one ArrayRecord per update) and runs its own functions:
`select_multikrum` + `aggregate_arrayrecords` (Krum / Multi-Krum), `np.median` over the
stacked arrays (FedMedian) and `trim_mean` (FedTrimmedAvg).

    python bench/aggregation.py --quick   # smoke run, small sizes
    python bench/aggregation.py           # n = 20, 50 x d = 1M, 10M
    python bench/aggregation.py --full    # plus Multi-Krum over 1,000 updates of d = 1M
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
CLAIM_1000 = 8.5  # seconds, Multi-Krum over 1,000 contributions of d = 1M


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


def worker(impl: str, rule: str, n: int, d: int) -> dict[str, Any]:
    """Time one call of `rule`, after a warm-up call on a small input (lazy init, thread pools)."""
    _prepare(impl, rule, n, 4096)[0]()
    call, input_bytes = _prepare(impl, rule, n, d)
    exact = _reset_peak()
    before = _rss_kib("VmRSS") if exact else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    result = call()
    seconds = time.perf_counter() - start
    peak = _rss_kib("VmHWM") if exact else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    del result
    return {
        "seconds": seconds,
        "extra_bytes": max(0, peak - before) * 1024,
        "input_bytes": input_bytes,
        "exact_peak": exact,
    }


def _prepare(impl: str, rule: str, n: int, d: int) -> tuple[Any, int]:
    """The call to time, its input already built the way each side holds it."""
    import numpy as np
    import torch

    f = _f(n)
    m = 1 if rule == "krum" else n - f
    x = torch.randn(n, d, generator=torch.Generator().manual_seed(0))  # (n, d) float32
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
    else:
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
        del x

        def layers() -> list[Any]:
            return [c.array_records["arrays"]["w"].numpy() for c in contents]

        calls = {
            "krum": lambda: aggregate_arrayrecords(
                select_multikrum(contents, f, m), "num-examples"
            ),
            "multikrum": lambda: aggregate_arrayrecords(
                select_multikrum(contents, f, m), "num-examples"
            ),
            "median": lambda: np.median(np.stack(layers()), axis=0),
            "trimmed_mean": lambda: trim_mean(np.stack(layers()), (f + 0.5) / n),
        }
        return calls[rule], input_bytes


def measure(impl: str, rule: str, n: int, d: int) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, __file__, "--worker", impl, rule, str(n), str(d)],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def _mb(b: float) -> str:
    return f"{b / 2**20:,.0f} MB"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="small sizes, a smoke run")
    size.add_argument("--full", action="store_true", help="also 1,000 updates of d = 1M")
    parser.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        impl, rule, n, d = args.worker
        print(json.dumps(worker(impl, rule, int(n), int(d))))
        return
    sizes = (
        [(20, 100_000), (50, 100_000)]
        if args.quick
        else [(n, d) for d in (1_000_000, 10_000_000) for n in (20, 50)]
    )
    print(f"threads: {os.cpu_count()} cpus visible; f = n // 5; multikrum m = n - f")
    header = f"| {'rule':<12} | {'n':>4} | {'d':>10} | {'input':>9} | {'ours s':>7} | {'Flower s':>8} | {'speed-up':>8} | {'ours extra mem':>18} | {'Flower extra mem':>16} |"
    print(header)
    print("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")
    for n, d in sizes:
        for rule in RULES:
            ours = measure("ours", rule, n, d)
            theirs = measure("flower", rule, n, d)
            share = ours["extra_bytes"] / ours["input_bytes"]
            print(
                f"| {rule:<12} | {n:>4} | {d:>10,} | {_mb(ours['input_bytes']):>9} | "
                f"{ours['seconds']:>7.2f} | {theirs['seconds']:>8.2f} | "
                f"{theirs['seconds'] / ours['seconds']:>7.1f}x | "
                f"{_mb(ours['extra_bytes']):>9} ({share:>4.1%}) | {_mb(theirs['extra_bytes']):>16} |",
                flush=True,
            )
    if args.full:
        big = measure("ours", "multikrum", 1000, 1_000_000)
        print(
            f"\nMulti-Krum, 1,000 updates x d = 1M ({_mb(big['input_bytes'])}): "
            f"{big['seconds']:.2f} s (claim to beat: {CLAIM_1000} s), extra memory "
            f"{_mb(big['extra_bytes'])} ({big['extra_bytes'] / big['input_bytes']:.1%} of input)"
        )


if __name__ == "__main__":
    main()
