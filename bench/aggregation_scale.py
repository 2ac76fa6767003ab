"""Benchmark: every aggregation rule straight from BitDelta payloads, at scale.

For each size (n updates of d values) and rule, each way in a fresh subprocess with a fixed
thread count, over the same n envelopes:

- ``stream``: the rule reads a `PayloadColumns` over the envelopes, which decodes column
  ranges of all n rows within ``--budget`` bytes per chunk (2 GiB by default, the
  coordinator's default aggregation memory); memory follows the budget, not n x d;
- ``in memory``: `decode_into` every payload into one (n, d) float32 buffer (timed apart),
  then the rule on the tensor; skipped, with the reason printed, where twice the buffer
  would not fit in the available memory;
- ``floor``: NumPy's sum over the rows of that (n, d) float32 buffer (``x.sum(axis=0)``),
  the least a rule that reads every value once costs, measured in the same process as the
  rule; where the buffer does not fit, over its first columns that do (at least 4,096;
  at most a quarter of the available memory), scaled to d (marked ``*``);
- ``Flower`` (Multi-Krum only): Flower's own ``select_multikrum`` + ``aggregate_arrayrecords``
  (what its ``MultiKrum`` strategy calls) over one ArrayRecord per decoded update, its first
  call and a warm second call; skipped, with the reason printed, where what it holds (the
  records, their flattened copies, the stacked (n, d) matrix and its square: 4 x n x d x 4
  bytes) would not fit in the available memory.

Payloads (`zoo_gym.compression.encode` of random float32 updates, group 128, float16 scales)
are generated once per d into a temporary file; each subprocess reads the first n. Peak
memory is the peak resident set during the call above what the process held just before it
(its payloads loaded, or its decoded buffer; reset through ``/proc/self/clear_refs``, Linux
only); "extra / input" is that over the (n, d) float32 size. A measurement that fails ends
the run with its error: no cell of an anchor is left empty. f = n // 10 for every rule
(FedAvg ignores it); Multi-Krum averages m = n - f.

    python bench/aggregation_scale.py --threads 2                  # n = 100, 300, 1000 x d = 1M
    python bench/aggregation_scale.py --n 100 --d 22000000 --threads 2
    python bench/aggregation_scale.py --n 1000 --d 22000000 --rule multikrum --threads 2

The last line of a run for one size and one rule reads
``n=N d=D R: T s, peak RSS P MiB above the payloads`` (the stream path).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

RULES = (
    "fedavg",
    "krum",
    "multikrum",
    "bulyan",
    "trimmed_mean",
    "median",
    "geometric_median",
    "centered_clipping",
)
PARAMS: dict[str, dict[str, Any]] = {"centered_clipping": {"tau": 1.0}}
GROUP = 128
MAX_ELEMENTS = 10**10
THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def _kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _available_bytes() -> int:
    with open("/proc/meminfo") as info:
        for line in info:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def _measure(fn: Callable[[], object], repeat: int) -> tuple[float, float]:
    """(fastest seconds of `repeat` calls, MiB of peak RSS of the first call above before it)."""
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # reset VmHWM to the current RSS
    before = _kib("VmRSS")
    times, peak = [], 0.0
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        if len(times) == 1:
            peak = (_kib("VmHWM") - before) / 1024
    return min(times), peak


def write_payloads(n: int, d: int, path: Path) -> None:
    """n BitDelta envelopes of random (d,) updates, laid end to end in `path` (one size)."""
    import torch

    from zoo_gym.compression import CodecSpec, encode

    spec = CodecSpec("bitdelta", GROUP)
    gen = torch.Generator().manual_seed(0)
    with path.open("wb") as out:
        for i in range(n):
            update = torch.randn(d, generator=gen) * (1.0 + (i % 7) / 7)
            out.write(encode({"w": update}, spec))


def _read_payloads(path: Path, n: int, d: int) -> list[bytes]:
    import torch

    from zoo_gym.compression import CodecSpec, encode

    size = len(encode({"w": torch.zeros(d)}, CodecSpec("bitdelta", GROUP)))
    with path.open("rb") as blob:
        return [blob.read(size) for _ in range(n)]


def run_one(args: argparse.Namespace) -> dict[str, Any]:
    """One measurement in this process: ``stream``, ``memory`` or ``flower``."""
    import torch

    from zoo_gym.aggregation import aggregate

    torch.set_num_threads(args.threads)
    n, d, rule = args.n, args.d, args.rule
    payloads = _read_payloads(Path(args.payloads), n, d)
    params = {"f": n // 10, **PARAMS.get(rule, {})}
    aggregate(rule, torch.randn(n, 64), **params)  # warm up the rule's code paths
    if args.mode == "flower":
        return _run_flower(payloads, n, d)
    if args.mode == "stream":
        return _run_stream(payloads, n, d, rule, params, args)
    return _run_memory(payloads, n, d, rule, params, args.repeat)


def _layout(d: int) -> Any:
    import torch

    from zoo_gym.core.delta import layout_of

    return layout_of({"w": torch.empty(d)})


def _run_stream(
    payloads: list[bytes],
    n: int,
    d: int,
    rule: str,
    params: dict[str, Any],
    args: argparse.Namespace,
) -> dict[str, Any]:
    """The rule from a `PayloadColumns`, and the floor over as many decoded columns as fit
    (all d where they do), scaled to d."""
    from zoo_gym.aggregation import aggregate
    from zoo_gym.compression.columns import PayloadColumns

    source = PayloadColumns(payloads, _layout(d), max_elements=MAX_ELEMENTS, budget=args.budget)
    stream = _measure(lambda: aggregate(rule, source, **params), args.repeat)
    width = min(d, max(4096, min(_available_bytes() // 4, 1 << 30) // (4 * n)))
    x = source.columns(0, min(d, width)).numpy()  # (n, width) float32
    seconds, _ = _measure(lambda: x.sum(axis=0), 3)
    return {"stream": stream, "floor": seconds * d / x.shape[1], "floor_columns": x.shape[1]}


def _run_memory(
    payloads: list[bytes], n: int, d: int, rule: str, params: dict[str, Any], repeat: int
) -> dict[str, Any]:
    """Decode into an (n, d) buffer (timed), the floor over it, then the rule on it."""
    import torch

    from zoo_gym.aggregation import aggregate
    from zoo_gym.compression import decode_into

    layout = _layout(d)
    x = torch.empty(n, d)

    def decode() -> None:
        for i, payload in enumerate(payloads):
            decode_into(payload, x[i], layout, max_elements=MAX_ELEMENTS)

    decoded = _measure(decode, 1)[0]
    rows = x.numpy()
    floor = _measure(lambda: rows.sum(axis=0), 3)[0]
    rule_s, extra = _measure(lambda: aggregate(rule, x, **params), repeat)
    return {"decode": decoded, "floor": floor, "floor_columns": d, "memory": (rule_s, extra)}


def _run_flower(payloads: list[bytes], n: int, d: int) -> dict[str, Any]:
    """Flower's Multi-Krum over one ArrayRecord per decoded update: first and warm call."""
    import torch
    from flwr.app import Array, ArrayRecord, MetricRecord, RecordDict
    from flwr.serverapp.strategy.multikrum import select_multikrum
    from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

    from zoo_gym.compression import decode_into

    layout, row = _layout(d), torch.empty(d)
    contents = []
    for payload in payloads:
        decode_into(payload, row, layout, max_elements=MAX_ELEMENTS)
        record = ArrayRecord({"w": Array(row.numpy().copy())})
        contents.append(RecordDict({"arrays": record, "metrics": MetricRecord({"n": 1})}))
    f = n // 10

    def call() -> object:
        return aggregate_arrayrecords(select_multikrum(contents, f, n - f), "n")

    first, extra = _measure(call, 1)
    warm, _ = _measure(call, 1)
    return {"flower": (first, extra), "flower_warm": warm}


def _flower_bytes(n: int, d: int) -> int:
    """What Flower's Multi-Krum holds at its peak: the records, their flattened copies, the
    stacked (n, d) float32 matrix and its square."""
    return 4 * n * d * 4


def _subprocess(argv: list[str], threads: int) -> dict[str, Any]:
    """Run one measurement; its failure ends the run with its error output."""
    env = dict(os.environ, **{name: str(threads) for name in THREAD_ENV})
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    done = subprocess.run(
        [sys.executable, __file__, *argv], capture_output=True, text=True, env=env
    )
    if done.returncode != 0:
        raise SystemExit(f"measurement {' '.join(argv)} failed:\n{done.stderr.strip()}")
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f} GiB"


def _measure_size(n: int, d: int, rule: str, argv: list[str], threads: int) -> dict[str, Any]:
    """Every way for one size and rule; a skipped way is printed with its reason."""
    result = _subprocess([*argv, "--mode", "stream"], threads)
    skip = f"n={n} d={d} {rule}: in memory skipped, 2 x (n, d) float32"
    result |= _if_it_fits(2 * n * d * 4, [*argv, "--mode", "memory"], threads, skip)
    if rule == "multikrum":
        need = _flower_bytes(n, d) + n * d // 7  # and the payloads, 1.125 bits a value
        skip = f"n={n} d={d}: Flower's Multi-Krum skipped, it holds 4 x (n, d) float32 and the payloads"
        result |= _if_it_fits(need, [*argv, "--mode", "flower"], threads, skip)
    return result


def _if_it_fits(need: int, argv: list[str], threads: int, skip: str) -> dict[str, Any]:
    """The measurement of `argv` when `need` bytes fit in the available memory; else {} and
    the line `skip` with the sizes."""
    free = _available_bytes()
    if need < free:
        return _subprocess(argv, threads)
    print(f"{skip} = {_gib(need)}, {_gib(free)} available", flush=True)
    return {}


def _row(n: int, d: int, rule: str, r: dict[str, Any]) -> str:
    """One table row: stream, in memory, floor and the ratios."""
    stream_s, stream_mib = r["stream"]
    star = "" if r["floor_columns"] == d else "*"
    cells = [str(n), f"{d:,}", rule, f"{stream_s:.2f}", f"{stream_mib:.0f}"]
    if "memory" in r:
        rule_s, extra = r["memory"]
        share = extra * 2**20 / (n * d * 4)
        total = r["decode"] + rule_s
        cells += [f"{r['decode']:.2f}", f"{rule_s:.2f}", f"{r['floor']:.3f}"]
        cells += [f"{rule_s / r['floor']:.1f}x", f"{share:.1%}", f"{stream_s / total:.2f}x"]
    else:
        cells += ["-", "-", f"{r['floor']:.3f}{star}", f"{stream_s / r['floor']:.1f}x{star}"]
        cells += ["-", "-"]
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, nargs="+", default=[100, 300, 1000])
    parser.add_argument("--d", type=int, nargs="+", default=[1_000_000])
    parser.add_argument("--rule", nargs="+", choices=RULES, default=list(RULES))
    parser.add_argument("--budget", type=int, default=2 << 30, help="bytes per chunk")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--payloads", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=("stream", "memory", "flower"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        args.n, args.d, args.rule = args.n[0], args.d[0], args.rule[0]
        print(json.dumps(run_one(args)))
        return
    print(
        f"{args.threads} thread(s), budget {args.budget} bytes, f = n // 10; load average "
        f"{os.getloadavg()[0]:.1f} at start"
    )
    rows, flower, last = [], [], ""
    with tempfile.TemporaryDirectory() as tmp:
        for d in args.d:
            path = Path(tmp) / f"payloads-{d}.bin"
            write_payloads(max(args.n), d, path)
            for n in args.n:
                for rule in args.rule:
                    argv = ["--one", "--n", str(n), "--d", str(d), "--rule", rule]
                    argv += ["--budget", str(args.budget), "--threads", str(args.threads)]
                    argv += ["--repeat", str(args.repeat), "--payloads", str(path)]
                    r = _measure_size(n, d, rule, argv, args.threads)
                    rows.append(_row(n, d, rule, r))
                    print(rows[-1], flush=True)
                    if "flower" in r:
                        flower.append(_flower_row(n, d, r))
                    stream_s, stream_mib = r["stream"]
                    last = f"n={n} d={d} {rule}: {stream_s:.2f} s, peak RSS {stream_mib:.0f} MiB "
                    last += "above the payloads"
    _tables(rows, flower, args.threads)
    print(last)


def _flower_row(n: int, d: int, r: dict[str, Any]) -> str:
    first, extra = r["flower"]
    ours = r["memory"][0] if "memory" in r else r["stream"][0]
    return (
        f"| {n} | {d:,} | {first:.2f} | {r['flower_warm']:.2f} | {extra:.0f} | "
        f"{ours:.2f} | {r['flower_warm'] / ours:.1f}x |"
    )


def _tables(rows: list[str], flower: list[str], threads: int) -> None:
    """The tables of the run, together at the end."""
    print(f"\n{threads} thread(s); times in s, memory in MiB; * floor over fewer columns, scaled")
    print(
        "| n | d | rule | stream s | stream peak MiB | decode s | rule s | floor s "
        "| rule / floor | extra / input | stream / (decode + rule) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    if flower:
        print("\nFlower's Multi-Krum (select_multikrum + aggregate_arrayrecords), ours in memory")
        print(
            "| n | d | Flower first s | Flower warm s | Flower peak MiB | ours s | Flower warm / ours |"
        )
        print("|---|---|---|---|---|---|---|")
        print("\n".join(flower))


if __name__ == "__main__":
    main()
