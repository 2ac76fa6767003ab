"""Benchmark: every aggregation rule straight from BitDelta payloads, at scale.

For each size (n updates of d values) and rule, three ways over the same input, each in a
fresh subprocess with a fixed thread count:

- ``payloads``: the rule reads a `PayloadColumns` over the n envelopes, which decodes one
  column range of all n rows at a time within ``--budget`` bytes per chunk (memory follows
  n x chunk width, not n x d);
- ``in memory``: `decode_into` every payload into one (n, d) float32 buffer, then the rule
  on the tensor (skipped where twice the buffer would not fit in the available memory);
- ``floor``: one ``torch.sum`` over the rows of that decoded (n, d) buffer, the least a
  rule that reads every value once can cost (timed only, in the ``in memory`` process).

Payloads (`zoo_gym.compression.encode` of random float32 updates, group 128, float16 scales)
are generated once per d and kept in a temporary file; each subprocess reads the first n.
Peak memory is the peak resident set during the call above what the process held with its
payloads loaded and the rule warmed up on a tiny input (reset through
``/proc/self/clear_refs``, Linux only); ``payloads`` and ``in memory`` each run in their own
process, so neither reuses memory the other freed. Times are the fastest
of ``--repeat`` calls. f = n // 10 for every rule (FedAvg ignores it).

    python bench/aggregation_scale.py                          # n = 100, 300 x d = 1M, every rule
    python bench/aggregation_scale.py --n 1000 --d 1000000 --rule krum --budget 67108864

The last line of a run for one size and one rule reads
``n=N d=D R: T s, peak RSS P MiB above the payloads`` (the payloads path).
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
    """One measurement in this process: ``payloads``, or ``in memory`` and then ``floor``."""
    import torch

    from zoo_gym.aggregation import aggregate
    from zoo_gym.compression import decode_into
    from zoo_gym.compression.columns import PayloadColumns
    from zoo_gym.core.delta import layout_of

    torch.set_num_threads(args.threads)
    n, d, rule = args.n, args.d, args.rule
    payloads = _read_payloads(Path(args.payloads), n, d)
    layout = layout_of({"w": torch.empty(d)})
    params = {"f": n // 10, **PARAMS.get(rule, {})}
    aggregate(rule, torch.randn(n, 64), **params)  # warm up the rule's code paths
    if args.mode == "payloads":
        source = PayloadColumns(payloads, layout, max_elements=MAX_ELEMENTS, budget=args.budget)
        return {"payloads": _measure(lambda: aggregate(rule, source, **params), args.repeat)}
    held: list[torch.Tensor] = []

    def in_memory() -> None:
        held.clear()
        x = torch.empty(n, d)
        for i, payload in enumerate(payloads):
            decode_into(payload, x[i], layout, max_elements=MAX_ELEMENTS)
        aggregate(rule, x, **params)
        held.append(x)

    result = {"in memory": _measure(in_memory, args.repeat)}
    result["floor"] = _measure(lambda: torch.sum(held[0], dim=0), args.repeat)
    return result


def _subprocess(argv: list[str], threads: int) -> dict[str, Any]:
    env = dict(os.environ, **{name: str(threads) for name in THREAD_ENV})
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    done = subprocess.run(
        [sys.executable, __file__, *argv], capture_output=True, text=True, env=env, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def _cell(result: dict[str, Any], key: str) -> tuple[str, str]:
    if key not in result:
        return "-", "-"
    seconds, mib = result[key]
    return f"{seconds:.3f}", f"{mib:.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, nargs="+", default=[100, 300])
    parser.add_argument("--d", type=int, nargs="+", default=[1_000_000])
    parser.add_argument("--rule", nargs="+", choices=RULES, default=list(RULES))
    parser.add_argument("--budget", type=int, default=16 << 20, help="bytes per chunk")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--payloads", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=("payloads", "memory"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        args.n, args.d, args.rule = args.n[0], args.d[0], args.rule[0]
        print(json.dumps(run_one(args)))
        return
    print(
        "| n | d | rule | payloads s | peak MiB | in memory s | peak MiB | floor s | vs in memory |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    last = ""
    with tempfile.TemporaryDirectory() as tmp:
        for d in args.d:
            path = Path(tmp) / f"payloads-{d}.bin"
            write_payloads(max(args.n), d, path)
            for n in args.n:
                for rule in args.rule:
                    argv = ["--one", "--n", str(n), "--d", str(d), "--rule", rule]
                    argv += ["--budget", str(args.budget), "--threads", str(args.threads)]
                    argv += ["--repeat", str(args.repeat), "--payloads", str(path)]
                    result = _subprocess([*argv, "--mode", "payloads"], args.threads)
                    if 2 * n * d * 4 < _available_bytes():
                        result |= _subprocess([*argv, "--mode", "memory"], args.threads)
                    (ps, pm), (ms, mm), (fs, _) = (
                        _cell(result, k) for k in ("payloads", "in memory", "floor")
                    )
                    ratio = f"{float(ps) / float(ms):.2f}x" if ms != "-" else "-"
                    print(f"| {n} | {d} | {rule} | {ps} | {pm} | {ms} | {mm} | {fs} | {ratio} |")
                    last = f"n={n} d={d} {rule}: {ps} s, peak RSS {pm} MiB above the payloads"
    print(last)


if __name__ == "__main__":
    main()
