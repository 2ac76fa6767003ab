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

With ``--device cuda`` every way runs on the GPU: the stream source holds the payloads' sign
bytes and scales on the GPU (uploaded once, "upload s") and decodes each chunk there; the
in-memory buffer is an (n, d) float32 GPU tensor (skipped, with the reason printed, where
twice it would not fit in the GPU's free memory); the floor is torch's ``x.sum(dim=0)`` over an
(n, width) float32 GPU tensor; Flower is skipped (it runs on the CPU) and never imported. Each
time waits for the GPU (``torch.cuda.synchronize``) before the clock is read; peak GPU memory
(``torch.cuda.max_memory_allocated``) is reported beside the peak RSS, the stream's as what the
source holds + the peak above it during the rule.

Payloads (`zoo_gym.compression.encode` of random float32 updates, group 128, float16 scales)
are generated once per d into a temporary file (on ``--device cuda`` drawn and packed on the
GPU); each subprocess reads the first n. Times are the fastest of ``--repeat`` calls (2 by
default: the first call of a process also pays for its threads starting and its heap growing,
once; the floor is the fastest of 3), peak memory that of the first call. Peak
memory is the peak resident set during the call above what the process held just before it
(its payloads loaded, or its decoded buffer; reset through ``/proc/self/clear_refs``, Linux
only); "extra / input" is that over the (n, d) float32 size. A measurement that fails ends
the run with its error: no cell of an anchor is left empty. f = n // 10 for every rule
(FedAvg ignores it); Multi-Krum averages m = n - f.

    python bench/aggregation_scale.py --threads 2                  # n = 100, 300, 1000 x d = 1M
    python bench/aggregation_scale.py --n 100 --d 22000000 --threads 2
    python bench/aggregation_scale.py --n 1000 --d 22000000 --rule multikrum --threads 2
    python bench/aggregation_scale.py --device cuda --n 1000 --d 22000000 --rule multikrum

The last line of a run for one size and one rule reads
``n=N d=D R: T s, peak RSS P MiB above the payloads`` (the stream path), followed on
``--device cuda`` by ``, peak GPU memory G MiB``.
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


def _measure(
    fn: Callable[[], object], repeat: int, device: str = "cpu"
) -> tuple[float, float, float]:
    """(fastest seconds of `repeat` calls, MiB of peak RSS of the first call above before it,
    MiB of peak GPU memory of the first call above what was allocated before it). On CUDA each
    call is timed to the end of its GPU work; the GPU figure is 0 on the CPU."""
    cuda = device != "cpu"
    if cuda:
        import torch

        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        allocated = torch.cuda.memory_allocated()
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # reset VmHWM to the current RSS
    before = _kib("VmRSS")
    times, peak, gpu = [], 0.0, 0.0
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        if len(times) == 1:
            peak = (_kib("VmHWM") - before) / 1024
            gpu = (torch.cuda.max_memory_allocated() - allocated) / 2**20 if cuda else 0.0
    return min(times), peak, gpu


def write_payloads(n: int, d: int, path: Path, device: str = "cpu") -> None:
    """n BitDelta envelopes of random (d,) updates, laid end to end in `path` (one size),
    drawn and packed on `device` (on CUDA by the Triton pack kernel)."""
    import torch

    from zoo_gym.compression import CodecSpec, encode

    spec = CodecSpec("bitdelta", GROUP)
    gen = torch.Generator(device=device).manual_seed(0)
    with path.open("wb") as out:
        for i in range(n):
            update = torch.randn(d, generator=gen, device=device) * (1.0 + (i % 7) / 7)
            out.write(encode({"w": update}, spec))
    if device != "cpu":
        torch.cuda.empty_cache()  # the measurements run in other processes


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
    aggregate(rule, torch.randn(n, 64, device=args.device), **params)  # warm up its code paths
    if args.mode == "flower":
        return _run_flower(payloads, n, d)
    if args.mode == "stream":
        return _run_stream(payloads, n, d, rule, params, args)
    return _run_memory(payloads, n, d, rule, params, args)


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
    """The rule from a `PayloadColumns` (built, and on CUDA uploaded, apart: "upload"), and
    the floor over as many decoded columns as fit (all d where they do), scaled to d."""
    from zoo_gym.aggregation import aggregate
    from zoo_gym.compression.columns import PayloadColumns

    device, sources = args.device, []

    def build() -> None:
        layout = _layout(d)
        sources.append(
            PayloadColumns(
                payloads, layout, max_elements=MAX_ELEMENTS, budget=args.budget, device=device
            )
        )

    upload = _measure(build, 1, device)[0]
    source = sources[0]
    held = _gpu_allocated() if device != "cpu" else 0.0
    seconds, rss, gpu = _measure(lambda: aggregate(rule, source, **params), args.repeat, device)
    width = min(d, max(4096, min(_free_bytes(device) // 4, 1 << 30) // (4 * n)))
    x = source.columns(0, min(d, width))  # (n, width) float32
    if device == "cpu":
        rows = x.numpy()
        floor = _measure(lambda: rows.sum(axis=0), 3)[0]
    else:
        floor = _measure(lambda: x.sum(dim=0), 3, device)[0]
    return {
        "stream": (seconds, rss),
        "stream_gpu": (held, gpu),
        "upload": upload,
        "resident": source.resident,
        "floor": floor * d / x.shape[1],
        "floor_columns": x.shape[1],
    }


def _free_bytes(device: str) -> int:
    """Bytes free for a buffer on `device`: the available memory, or the GPU's free memory."""
    if device == "cpu":
        return _available_bytes()
    import torch

    return int(torch.cuda.mem_get_info()[0])


def _gpu_allocated() -> float:
    """MiB of GPU memory this process has allocated."""
    import torch

    return torch.cuda.memory_allocated() / 2**20


def _run_memory(
    payloads: list[bytes],
    n: int,
    d: int,
    rule: str,
    params: dict[str, Any],
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Decode into an (n, d) buffer on the device (timed), the floor over it, then the rule
    on it; on CUDA skipped, with the reason, where twice the buffer does not fit."""
    import torch

    from zoo_gym.aggregation import aggregate
    from zoo_gym.compression import decode_into

    device, layout = args.device, _layout(d)
    if device != "cpu" and 2 * n * d * 4 >= (free := _free_bytes(device)):
        need = _gib(2 * n * d * 4)
        return {"skipped": f"2 x (n, d) float32 = {need}, {_gib(free)} free on the GPU"}
    x = torch.empty(n, d, device=device)

    def decode() -> None:
        for i, payload in enumerate(payloads):
            decode_into(payload, x[i], layout, max_elements=MAX_ELEMENTS)

    decoded = _measure(decode, 1, device)[0]
    if device == "cpu":
        rows = x.numpy()
        floor = _measure(lambda: rows.sum(axis=0), 3)[0]
    else:
        floor = _measure(lambda: x.sum(dim=0), 3, device)[0]
    rule_s, extra, gpu = _measure(lambda: aggregate(rule, x, **params), args.repeat, device)
    if device != "cpu":
        extra = gpu  # the rule's memory is on the GPU
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

    first, extra, _ = _measure(call, 1)
    warm = _measure(call, 1)[0]
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


def _measure_size(
    n: int, d: int, rule: str, argv: list[str], threads: int, device: str
) -> dict[str, Any]:
    """Every way for one size and rule; a skipped way is printed with its reason."""
    result = _subprocess([*argv, "--mode", "stream"], threads)
    skip = f"n={n} d={d} {rule}: in memory skipped, 2 x (n, d) float32"
    if device != "cpu":  # the subprocess compares with the GPU's free memory
        if not result["resident"]:
            print(
                f"n={n} d={d} {rule}: the signs did not fit on the GPU, chunks decoded on the CPU"
            )
        memory = _subprocess([*argv, "--mode", "memory"], threads)
        if "skipped" in memory:
            reason = memory.pop("skipped")
            print(f"n={n} d={d} {rule}: in memory skipped on the GPU, {reason}", flush=True)
        result |= memory
        if rule == "multikrum":
            print(f"n={n} d={d}: Flower's Multi-Krum skipped on {device}, it runs on the CPU")
        return result
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


def _row(n: int, d: int, rule: str, r: dict[str, Any], device: str) -> str:
    """One table row: stream, in memory, floor and the ratios."""
    stream_s, stream_mib = r["stream"]
    star = "" if r["floor_columns"] == d else "*"
    cells = [str(n), f"{d:,}", rule, f"{stream_s:.2f}", f"{stream_mib:.0f}"]
    if device != "cpu":
        cells[3:3] = [f"{r['upload']:.2f}"]
    if "memory" in r:
        rule_s, extra = r["memory"]
        share = extra * 2**20 / (n * d * 4)
        total = r["decode"] + rule_s
        cells += [f"{r['decode']:.2f}", f"{rule_s:.2f}", f"{r['floor']:.3f}"]
        cells += [f"{rule_s / r['floor']:.1f}x", f"{share:.1%}", f"{stream_s / total:.2f}x"]
    else:
        cells += ["-", "-", f"{r['floor']:.3f}{star}", f"{stream_s / r['floor']:.1f}x{star}"]
        cells += ["-", "-"]
    if device != "cpu":
        held, above = r["stream_gpu"]
        cells += [f"{held:.0f} + {above:.0f}"]
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, nargs="+", default=[100, 300, 1000])
    parser.add_argument("--d", type=int, nargs="+", default=[1_000_000])
    parser.add_argument("--rule", nargs="+", choices=RULES, default=list(RULES))
    parser.add_argument("--budget", type=int, default=2 << 30, help="bytes per chunk")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--repeat",
        type=int,
        default=2,
        help="calls per cell; the fastest is reported (the floor: fastest of 3)",
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--payloads", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=("stream", "memory", "flower"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        args.n, args.d, args.rule = args.n[0], args.d[0], args.rule[0]
        print(json.dumps(run_one(args)))
        return
    device = args.device
    if device == "cuda" and not _cuda_available():
        parser.error("--device cuda: torch sees no CUDA device here; run it on a GPU machine")
    on = "" if device == "cpu" else f" on {_device_name()}"
    print(
        f"{args.threads} thread(s){on}, budget {args.budget} bytes, f = n // 10; load average "
        f"{os.getloadavg()[0]:.1f} at start"
    )
    rows, flower, last = [], [], ""
    with tempfile.TemporaryDirectory() as tmp:
        for d in args.d:
            path = Path(tmp) / f"payloads-{d}.bin"
            began = time.perf_counter()
            write_payloads(max(args.n), d, path, device)
            if device != "cpu":
                spent = time.perf_counter() - began
                print(
                    f"{max(args.n)} payloads of d={d} drawn and packed on the GPU in {spent:.1f} s"
                )
            for n in args.n:
                for rule in args.rule:
                    argv = ["--one", "--n", str(n), "--d", str(d), "--rule", rule]
                    argv += ["--budget", str(args.budget), "--threads", str(args.threads)]
                    argv += ["--repeat", str(args.repeat), "--payloads", str(path)]
                    argv += ["--device", device]
                    r = _measure_size(n, d, rule, argv, args.threads, device)
                    rows.append(_row(n, d, rule, r, device))
                    print(rows[-1], flush=True)
                    if "flower" in r:
                        flower.append(_flower_row(n, d, r))
                    last = _last_line(n, d, rule, r, device)
    _tables(rows, flower, args.threads, device)
    print(last)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _device_name() -> str:
    import torch

    return torch.cuda.get_device_name()


def _last_line(n: int, d: int, rule: str, r: dict[str, Any], device: str) -> str:
    """``n=N d=D R: T s, peak RSS P MiB above the payloads`` (the stream path), and on a GPU
    ``, peak GPU memory G MiB`` (what the source holds and the peak above it)."""
    stream_s, stream_mib = r["stream"]
    last = f"n={n} d={d} {rule}: {stream_s:.2f} s, peak RSS {stream_mib:.0f} MiB above the payloads"
    if device != "cpu":
        held, above = r["stream_gpu"]
        last += f", peak GPU memory {held + above:.0f} MiB"
    return last


def _flower_row(n: int, d: int, r: dict[str, Any]) -> str:
    first, extra = r["flower"]
    ours = r["memory"][0] if "memory" in r else r["stream"][0]
    return (
        f"| {n} | {d:,} | {first:.2f} | {r['flower_warm']:.2f} | {extra:.0f} | "
        f"{ours:.2f} | {r['flower_warm'] / ours:.1f}x |"
    )


def _tables(rows: list[str], flower: list[str], threads: int, device: str) -> None:
    """The tables of the run, together at the end."""
    print(f"\n{threads} thread(s); times in s, memory in MiB; * floor over fewer columns, scaled")
    if device == "cpu":
        print(
            "| n | d | rule | stream s | stream peak MiB | decode s | rule s | floor s "
            "| rule / floor | extra / input | stream / (decode + rule) |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|")
    else:
        print(
            "| n | d | rule | upload s | stream s | stream peak MiB | decode s | rule s | floor s "
            "| rule / floor | extra / input (GPU) | stream / (decode + rule) "
            "| stream GPU MiB (source + rule) |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
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
