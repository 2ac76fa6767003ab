"""Many BitDelta variants in one batch against the base alone and one merged copy per variant.

    python bench/serving.py --model tiny --variants 1,10,100,1000
    python bench/serving.py --model qwen2.5-0.5b --variants 1,10,100 --new-tokens 8
    python bench/serving.py --model qwen2.5-0.5b --profile 100 --new-tokens 2
    python bench/serving.py --model qwen2.5-0.5b --profile 100 --new-tokens 8 --device cuda
    python bench/serving.py --kernel 4864x896 --variants 100
    python bench/serving.py --kernel 4864x896 --variants 100 --device cuda
    python bench/serving.py --model qwen2.5-0.5b --variants 1,10,100,1000 --device cuda

For each count n of distinct variants, a batch of B = max(n, --min-batch) rows (row r uses
variant r % n) decodes --new-tokens tokens greedily with a KV cache after a prompt of
--prompt tokens, three ways, each in a process of its own (so each peak RSS is its own):

- base: the base model alone on the same batch (the anchor);
- mixed: `zoo_gym.serving.variants.attach` on the base, every row its variant, no merged weights;
- merged: one merged copy P + decode(variant) per variant, each running its own rows (only where
  n copies fit in --merged-limit bytes of float32 weights).

Tokens per second count decode steps only (B x new tokens over their time; the prompt's forward
and one warm-up step are not timed; the fastest of --repeats runs is kept). The mixed and merged
processes time the base alone too, interleaved with their own runs, and their ratios are
against that (the machine's load changes between processes); the base process gives the base
column and the base's peak RSS. The models are the tiny test model (`zoo_gym.core.tiny`) and a randomly
initialised model with Qwen2.5-0.5B's configuration; variants are random deltas
(0.01 x N(0, 1) per weight) written as BitDelta envelopes with records as
`gym-coordinator variant` writes them (group 128, float16 scales). Everything is float32 on
the CPU; the bytes of a variant are compared with the bf16 model's (2 bytes per parameter).

--device cuda runs the models in bfloat16 on the GPU, as `gym-serve --device cuda` does (the
variants' products through the Triton kernel, the variants generated there too), synchronises
before reading each clock, and reports the peak GPU memory allocated beside the peak RSS.

--profile n times the decode steps of the base alone and of n distinct variants (mixed) on
the same batch, then runs one more mixed step under cProfile and says where it went: the
compiled kernel, the rest of the linear hooks around it (argument lists, conversions, adding
the products), the embedding and norm hooks, the base's own linear layers, and the rest of
the model's forward. With --device cuda the kernel's part is the Triton launch (its arguments
and tables), and one more step is timed synchronised and traced by torch.profiler: the GPU
kernels' own time summed against that wall time says whether the step waits on the GPU or on
Python, and the five kernels that took longest are listed.

--kernel OUTxIN times the compiled kernel alone on one (OUT, IN) layer of --variants distinct
random variants, one row each (group 128, float16 scales), on one thread and on torch's, as
gigabytes of sign bits read per second, against numpy's sum (one thread) and torch's (torch's
threads) over 2 GiB of float64 in the same run: how near the kernel runs to the memory's speed.
With --device cuda it times the Triton kernels on bfloat16 rows instead (`triton.testing.
do_bench`): the GEMV that a decode step's one row per variant takes and the tiled dot it
replaced there, against a device-to-device copy of 2 GiB.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from realistic_round import qwen25_05b_config  # bench/ is on the path of a bench script
from transformers import AutoModelForCausalLM, PreTrainedModel

from zoo_gym.compression import CodecSpec, encode
from zoo_gym.core.hashing import sha256_bytes
from zoo_gym.core.tiny import build_tiny_model
from zoo_gym.core.weights import load_weights

BASE = "v0000"


def build_base(model: str, directory: Path) -> None:
    """Save the base model (float32) of `model` into `directory`, once."""
    if (directory / "config.json").exists():
        return
    torch.manual_seed(0)
    if model == "tiny":
        net: PreTrainedModel = build_tiny_model(vocab_size=512)
    else:
        config = qwen25_05b_config()
        net = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    net.save_pretrained(directory)


def write_variants(models: Path, count: int, device: str = "cpu") -> None:
    """Random variants var0001 .. of the base, as envelopes and records (missing ones only),
    their deltas drawn on `device`."""
    weights = {k: v.to(device) for k, v in load_weights(models / BASE).items()}
    spec = CodecSpec("bitdelta", group_size=128)
    (models / "variants").mkdir(exist_ok=True)
    for i in range(1, count + 1):
        version = f"var{i:04d}"
        stem = models / "variants" / f"{version}-from-{BASE}"
        if stem.with_suffix(".json").exists():
            continue
        gen = torch.Generator(device).manual_seed(i)
        delta = {
            k: 0.01 * torch.randn(v.shape, generator=gen, device=device)
            for k, v in sorted(weights.items())
        }
        payload = encode(delta, spec)
        stem.with_suffix(".zgde").write_bytes(payload)
        record = dict(
            version=version,
            parent=BASE,
            codec="bitdelta",
            group_size=128,
            sha256=sha256_bytes(payload),
            size=len(payload),
            distilled=False,
            format=1,
        )
        stem.with_suffix(".json").write_text(json.dumps(record, sort_keys=True, indent=1))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _decode_once(model: torch.nn.Module, ids: torch.Tensor, new_tokens: int) -> float:
    out = model(ids, use_cache=True)
    past, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    out = model(token, past_key_values=past, use_cache=True)  # one step untimed: warm-up
    past, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    _sync(ids.device)
    start = time.perf_counter()
    for _ in range(new_tokens):
        out = model(token, past_key_values=past, use_cache=True)
        past, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    _sync(ids.device)
    return time.perf_counter() - start


def _load_base(models: Path, device: torch.device) -> PreTrainedModel:
    """The base model as `gym-serve` runs it on `device`: float32 on the CPU, bfloat16 else."""
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(models / BASE, dtype=dtype)
    return model.to(device).eval()  # type: ignore[no-any-return]


def _best(runs: list[Callable[[], float]], repeats: int) -> list[float]:
    """The fastest seconds of each run, the runs interleaved `repeats` times (so a ratio
    between them sees the same load on the machine)."""
    best = [float("inf")] * len(runs)
    for _ in range(repeats):
        for i, run in enumerate(runs):
            best[i] = min(best[i], run())
    return best


def _merged_copies(models: Path, n: int, device: torch.device) -> list[torch.nn.Module]:
    """One model per variant with P + decode(variant) loaded, as the base runs on `device`."""
    from zoo_gym.coordinator.variants import apply_variant

    state = load_weights(models / BASE)  # as saved: a tied head is stored once
    copies = []
    for k in range(n):
        payload = (models / "variants" / f"var{k + 1:04d}-from-{BASE}.zgde").read_bytes()
        copy = AutoModelForCausalLM.from_pretrained(models / BASE, dtype=torch.float32)
        missing = copy.load_state_dict(apply_variant(state, payload), strict=False)
        assert set(missing.missing_keys) <= {"lm_head.weight"}, missing  # tied to the embedding
        dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
        copies.append(copy.to(device, dtype).eval())
    return copies


def run_one(args: argparse.Namespace) -> dict[str, float]:
    """One measurement (mode, n variants) in this process, the base alone timed beside it."""
    from zoo_gym.serving.variants import VariantStore, attach

    models = Path(args.workdir) / args.model / "models"
    n, mode, steps = args.one_variants, args.one_mode, args.new_tokens
    batch, device = max(n, args.min_batch), torch.device(args.device)
    base = _load_base(models, device)
    ids = torch.randint(
        4, base.config.vocab_size, (batch, args.prompt), generator=torch.Generator().manual_seed(0)
    ).to(device)
    figures: dict[str, float] = {"batch": batch}
    runs = [lambda: _decode_once(base, ids, steps)]
    if mode == "mixed":
        store = VariantStore(models, BASE, budget_bytes=1 << 40, device=device)
        mixed = attach(base, store)
        rows = [store.get(f"var{1 + r % n:04d}") for r in range(batch)]
        figures["variant_bytes"] = store.nbytes / n

        def run_mixed() -> float:
            with mixed.assign(rows):
                return _decode_once(base, ids, steps)

        runs.append(run_mixed)
    elif mode == "merged":
        copies = _merged_copies(models, n, device)  # each copy decodes its own rows
        runs.append(lambda: sum(_decode_once(c, ids[k::n], steps) for k, c in enumerate(copies)))
    with torch.no_grad():
        seconds = _best(runs, args.repeats)
    figures["base_tokens_per_s"] = batch * steps / seconds[0]
    figures["tokens_per_s"] = batch * steps / seconds[-1]
    figures["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if device.type == "cuda":
        figures["peak_gpu_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
    return figures


def _hook_lines(method: Callable[..., object]) -> set[int]:
    """First lines of the `hook` closures that a MixedModel hook factory makes."""
    return {
        c.co_firstlineno
        for c in method.__code__.co_consts
        if hasattr(c, "co_name") and c.co_name == "hook"
    }


def _profile_parts(stats: pstats.Stats) -> dict[str, float]:
    """Seconds of one profiled mixed step by part (see --profile)."""
    from zoo_gym.serving import variants

    lines = {
        "linear": _hook_lines(variants.MixedModel._linear_hook),
        "embedding": _hook_lines(variants.MixedModel._embedding_hook),
        "norm": _hook_lines(variants.MixedModel._vector_hook),
    }
    parts = dict.fromkeys(["kernel", "linear", "embedding", "norm", "base linear"], 0.0)
    for (filename, line, name), row in stats.stats.items():  # type: ignore[attr-defined]
        own, total = row[2], row[3]
        if "_binary_gemm" in name:
            parts["kernel"] += own
        elif filename.endswith("serving/kernels.py") and name == "accumulate":
            parts["kernel"] += total  # on CUDA: the Triton launch, its arguments and tables
        elif name == "<built-in method torch._C._nn.linear>":
            parts["base linear"] += own
        elif filename.endswith("serving/variants.py") and name == "hook":
            for part, hooks in lines.items():
                parts[part] += total if line in hooks else 0.0
    parts["linear"] -= parts["kernel"]
    return parts


def profile(args: argparse.Namespace) -> None:
    """Where a decode step of --profile distinct variants goes (module docstring)."""
    from zoo_gym.serving.variants import VariantStore, attach

    models = Path(args.workdir) / args.model / "models"
    n, steps = args.profile, args.new_tokens
    batch, device = max(n, args.min_batch), torch.device(args.device)
    base = _load_base(models, device)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(4, base.config.vocab_size, (batch, args.prompt), generator=gen).to(device)
    store = VariantStore(models, BASE, budget_bytes=1 << 40, device=device)
    mixed = attach(base, store)
    rows = [store.get(f"var{1 + r % n:04d}") for r in range(batch)]

    def run_mixed() -> float:
        with mixed.assign(rows):
            return _decode_once(base, ids, steps)

    with torch.no_grad():
        alone, together = _best([lambda: _decode_once(base, ids, steps), run_mixed], args.repeats)
        with mixed.assign(rows):
            out = base(ids, use_cache=True)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            profiler = cProfile.Profile()
            profiler.runcall(base, token, past_key_values=out.past_key_values, use_cache=True)
            if device.type == "cuda":
                gpu = _gpu_step(base, token, out.past_key_values)
    stats = pstats.Stats(profiler)
    parts = _profile_parts(stats)
    step = stats.total_tt  # type: ignore[attr-defined]
    print(
        f"{args.model}: batch {batch} of {n} distinct variants, {torch.get_num_threads()} threads"
    )
    print("| part | ms per decode step |\n|---|---|")
    print(f"| base alone, whole step | {1e3 * alone / steps:.1f} |")
    print(f"| mixed, whole step | {1e3 * together / steps:.1f} |")
    print(f"| one mixed step under cProfile | {1e3 * step:.1f} |")
    names = {
        "kernel": "compiled kernel (the 1-bit products)",
        "linear": "linear hooks around the kernel (lists, conversions, adds; LM head too)",
        "embedding": "embedding hook (each row's delta rows)",
        "norm": "norm hooks (per-row norm weights)",
        "base linear": "the base's linear layers (torch)",
    }
    for key, label in names.items():
        print(f"| {label} | {1e3 * parts[key]:.1f} |")
    if device.type == "cuda":
        print(f"| one mixed step, wall (synchronised) | {gpu['wall_ms']:.1f} |")
        print(f"| one mixed step, GPU kernels' own time summed | {gpu['kernels_ms']:.1f} |")
        for name, ms in gpu["top"]:
            print(f"| kernel {name[:60]} | {ms:.2f} |")


def _gpu_step(model: torch.nn.Module, token: torch.Tensor, past: object) -> dict[str, Any]:
    """One more step on CUDA: its synchronised wall time and the GPU kernels' own time
    (torch.profiler), in ms, with the five kernels that took longest."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as trace

    torch.cuda.synchronize()
    start = time.perf_counter()
    model(token, past_key_values=past, use_cache=True)
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    with trace(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as run:
        model(token, past_key_values=past, use_cache=True)
        torch.cuda.synchronize()
    events = [e for e in run.key_averages() if e.self_device_time_total > 0]
    events.sort(key=lambda e: -e.self_device_time_total)
    return {
        "wall_ms": 1e3 * wall,
        "kernels_ms": sum(e.self_device_time_total for e in events) / 1e3,
        "top": [(e.key, e.self_device_time_total / 1e3) for e in events[:5]],
    }


def kernel(args: argparse.Namespace) -> None:
    """The compiled kernel on one layer against the memory's read speed (module docstring)."""
    import numpy as np

    from zoo_gym.serving import binary
    from zoo_gym.serving.packed import PackedTensor

    out_features, in_features = (int(v) for v in args.kernel.split("x"))
    n = int(args.variants.split(",")[-1])
    gen = torch.Generator().manual_seed(0)
    weights = []
    for k in range(n):
        bits = np.random.default_rng(k).bytes(out_features * in_features // 8)
        scales = 0.01 * torch.rand(out_features * in_features // 128, generator=gen) + 1e-3
        packed = torch.frombuffer(bytearray(bits), dtype=torch.uint8)
        weight = PackedTensor((out_features, in_features), packed, scales.half(), 128)
        weights.append(binary.kernel_layout(weight))  # as `gym-serve` loads it
    x, out = torch.randn(n, in_features, generator=gen), torch.zeros(n, out_features)
    prepared, rows, starts = binary.operands(weights), torch.arange(n), list(range(n + 1))
    array = np.ones(2**30 // 4)  # 2 GiB of float64
    tensor = torch.from_numpy(array)
    threads = torch.get_num_threads()
    runs: dict[str, tuple[Callable[[], object], float]] = {
        "numpy sum, 1 thread": (array.sum, array.nbytes),
        f"torch sum, {threads} threads": (tensor.sum, array.nbytes),
    }
    for t in sorted({1, threads}):
        run = partial(binary.accumulate, out, x, rows, prepared, starts, threads=t)
        runs[f"kernel, {t} thread(s)"] = (run, n * out_features * in_features / 8)
    seconds = _best([partial(_seconds, run) for run, _ in runs.values()], args.repeats)
    print(
        f"{out_features}x{in_features} layer, {n} variants x 1 row: {n * out_features * in_features / 8e6:.1f} MB of sign bits"
    )
    print("| read | ms | GB/s |\n|---|---|---|")
    for (name, (_, nbytes)), t in zip(runs.items(), seconds, strict=True):
        print(f"| {name} | {1e3 * t:.2f} | {nbytes / t / 1e9:.2f} |")


def kernel_cuda(args: argparse.Namespace) -> None:
    """The Triton kernels alone on one (OUT, IN) layer of --variants distinct random variants,
    one bfloat16 row each, on the GPU: the GEMV for one row per variant and the tiled dot
    it replaces there, as gigabytes of sign bits read per second, against a device-to-device
    copy of 2 GiB (bytes read and written) in the same run (module docstring)."""
    import triton.testing

    from zoo_gym.serving import kernels as triton_kernels
    from zoo_gym.serving.packed import PackedTensor

    out_features, in_features = (int(v) for v in args.kernel.split("x"))
    n, device = int(args.variants.split(",")[-1]), torch.device(args.device)
    gen = torch.Generator(device).manual_seed(0)
    weights = []
    for _ in range(n):
        bits = torch.randint(
            0,
            256,
            (out_features * in_features // 8,),
            generator=gen,
            device=device,
            dtype=torch.uint8,
        )
        scales = (
            0.01 * torch.rand(out_features * in_features // 128, generator=gen, device=device)
            + 1e-3
        )
        weights.append(PackedTensor((out_features, in_features), bits, scales.half(), 128))
    x = torch.randn(n, in_features, generator=gen, device=device).bfloat16()
    out = torch.zeros(n, out_features, device=device, dtype=torch.bfloat16)
    rows, starts = torch.arange(n, device=device), list(range(n + 1))
    table = triton_kernels.table(weights)
    source = torch.empty(2**30, device=device, dtype=torch.int16)
    target = torch.empty_like(source)

    def launch(gemv_rows: int) -> Callable[[], object]:
        def run() -> None:  # one row per variant: 1 takes the GEMV, 0 the tiled dot
            triton_kernels.GEMV_ROWS = gemv_rows
            triton_kernels.accumulate(out, x, rows, weights, starts, table)

        return run

    sign_bytes = n * out_features * in_features / 8
    runs = {
        "device-to-device copy (read + write)": (partial(target.copy_, source), 2 * source.nbytes),
        "GEMV kernel": (launch(1), sign_bytes),
        "tiled dot kernel": (launch(0), sign_bytes),
    }
    default, seconds = triton_kernels.GEMV_ROWS, {}
    try:
        for name, (run, _) in runs.items():
            run()  # compiles
            torch.cuda.synchronize()
            seconds[name] = triton.testing.do_bench(run, warmup=5, rep=50) / 1e3
    finally:
        triton_kernels.GEMV_ROWS = default
    print(
        f"{out_features}x{in_features} layer, {n} variants x 1 bfloat16 row, "
        f"{torch.cuda.get_device_name(device)}: {sign_bytes / 1e6:.1f} MB of sign bits"
    )
    print("| read | ms | GB/s |\n|---|---|---|")
    for name, (_, nbytes) in runs.items():
        t = seconds[name]
        print(f"| {name} | {1e3 * t:.3f} | {nbytes / t / 1e9:.0f} |")


def _seconds(run: Callable[[], object]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def _measure(args: argparse.Namespace, n: int, mode: str) -> dict[str, float]:
    """`run_one` in a fresh process (under the --lock file when given)."""
    command = [sys.executable, __file__, "--model", args.model, "--workdir", args.workdir]
    command += ["--min-batch", str(args.min_batch), "--prompt", str(args.prompt)]
    command += ["--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats)]
    command += ["--device", args.device]
    command += ["--one-variants", str(n), "--one-mode", mode]
    if args.lock:
        command = ["flock", args.lock, *command]
    done = subprocess.run(command, capture_output=True, text=True, check=False, env=os.environ)
    if done.returncode != 0:
        raise SystemExit(f"{mode} with {n} variants failed:\n{done.stderr[-3000:]}")
    figures: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return figures


def _row(args: argparse.Namespace, n: int, params: int) -> str:
    packed_estimate = params // 8 + 2 * params // 128  # signs and float16 scales
    base = _measure(args, n, "base")
    mixed = _measure(args, n, "mixed") if n * packed_estimate <= args.mixed_limit else None
    merged = _measure(args, n, "merged") if n * 4 * params <= args.merged_limit else None

    def rate(figures: dict[str, float] | None) -> str:
        if figures is None:
            return "does not fit | -"
        ratio = figures["tokens_per_s"] / figures["base_tokens_per_s"]  # the same process
        return f"{figures['tokens_per_s']:.1f} | {ratio:.2f}"

    share = f"1/{2 * params / mixed['variant_bytes']:.1f}" if mixed else "-"
    runs = (base, mixed, merged)
    memory = " / ".join(f"{f['peak_rss_mib']:.0f}" if f else "-" for f in runs)
    if args.device != "cpu":
        memory += " | " + " / ".join(f"{f['peak_gpu_mib']:.0f}" if f else "-" for f in runs)
    return (
        f"| {n} | {base['batch']:.0f} | {base['tokens_per_s']:.1f} | {rate(mixed)} | "
        f"{rate(merged)} | {share} | {memory} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=["tiny", "qwen2.5-0.5b"], default="tiny")
    parser.add_argument("--variants", default="1,10,100,1000", help="counts of distinct variants")
    parser.add_argument("--min-batch", type=int, default=8, help="smallest batch")
    parser.add_argument("--prompt", type=int, default=16, help="prompt tokens per row")
    parser.add_argument("--new-tokens", type=int, default=32, help="decode steps timed")
    parser.add_argument("--repeats", type=int, default=3, help="decode runs, the fastest kept")
    parser.add_argument("--workdir", default="/tmp/zoo-serving-bench", help="models, variants")
    parser.add_argument("--lock", default="", help="flock file held around each measurement")
    parser.add_argument("--merged-limit", type=float, default=8 * 2**30, help="bytes of copies")
    parser.add_argument("--mixed-limit", type=float, default=12 * 2**30, help="bytes of variants")
    parser.add_argument("--profile", type=int, default=0, help="profile n distinct variants")
    parser.add_argument("--kernel", default="", help="OUTxIN: the kernel alone on one layer")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (bfloat16 there)")
    parser.add_argument("--one-variants", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--one-mode", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one_mode:
        print(json.dumps(run_one(args)))
        return
    if args.kernel:
        kernel(args) if args.device == "cpu" else kernel_cuda(args)
        return
    counts = [args.profile] if args.profile else [int(c) for c in args.variants.split(",")]
    models = Path(args.workdir) / args.model / "models"
    build_base(args.model, models / BASE)
    write_variants(models, max(counts), args.device)
    if args.profile:
        profile(args)
        return
    params = sum(t.numel() for t in load_weights(models / BASE).values())
    where = f"{torch.get_num_threads()} threads"
    if args.device != "cpu":
        where = f"{torch.cuda.get_device_name(args.device)}, bfloat16"
    print(
        f"{args.model}: {params:,} parameters, bf16 {2 * params / 2**20:.1f} MiB; "
        f"prompt {args.prompt}, {args.new_tokens} new tokens, {where}"
    )
    gpu = (" | peak GPU MiB base / mixed / merged", "|---") if args.device != "cpu" else ("", "")
    print(
        "| variants | batch | base tok/s | mixed tok/s | mixed / base | merged tok/s | "
        f"merged / base | variant / bf16 model | peak RSS MiB base / mixed / merged{gpu[0]} |"
    )
    print(f"|---|---|---|---|---|---|---|---|---{gpu[1]}|")
    for n in counts:
        print(_row(args, n, params), flush=True)


if __name__ == "__main__":
    main()
