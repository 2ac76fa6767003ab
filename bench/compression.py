"""BitDelta pack/unpack throughput against a plain copy, and compressed sizes versus bf16.

Run: python bench/compression.py. Every operation is timed interleaved with its anchor, a
`torch.Tensor.copy_` of the same float32 tensors into preallocated tensors, so both see the
same machine load; the table gives medians and the ratio copy time / operation time
(target >= 0.5 on CPU). Rows:

- ``pack`` / ``unpack``: `bitdelta.pack_many` / `bitdelta.unpack_many` (the codec itself);
- ``encode`` / ``decode_into``: the whole envelope (header, SHA-256, scale checks) as a client
  encodes it and the coordinator decodes it into one row of its (n, d) buffer.

Both the operation and its anchor run with ``--threads`` torch threads (default 1: on a shared
machine, OpenMP threads that wait for a busy core distort small operations).

With a CUDA device (and Triton) a GPU table follows, each row again interleaved with its anchor,
a device-to-device ``copy_`` of the same float32 tensors on the GPU (synchronised around every
call): ``pack`` / ``unpack`` are the Triton kernels alone on device buffers (one launch per
tensor); ``encode`` is the envelope of CUDA tensors (kernel, one copy of signs and scales to the
host, SHA-256); ``decode_into`` decodes the payload into one CUDA row (one copy of signs and
scales to the device, kernel). Without CUDA the section says so and is skipped;
``--gpu-only`` skips the CPU tables.

``--stages`` prints instead where ``encode`` of the two large workloads spends its time, each
stage timed alone against the same anchor (see `stage_rows`).

A second table gives, for ``pack`` and ``encode`` of the two large workloads, the peak resident
memory of one call in a fresh process above what that process held before it (Linux: the peak
is reset through ``/proc/self/clear_refs``), against the input's size: the encoder needs its
output (and, on the numpy path, ~1 MiB of chunk buffers), not a copy of the input.

The first line says which CPU pack ran: the compiled pass (`zoo_gym/compression/_bitpack.c`,
with the kernel it chose) or the numpy path where the extension was not built.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import numpy as np
import torch

from zoo_gym.compression import CODECS, CodecSpec, bitdelta, decode_into, encode, envelope, kernels
from zoo_gym.core.delta import layout_of, numel
from zoo_gym.core.lora import LoraSpec, target_weights, update_key
from zoo_gym.core.tiny import build_tiny_model

REPEATS = 21
GROUP = 128


def ratio_to_copy(fn: Callable[[], object], copy: Callable[[], object]) -> tuple[float, float]:
    """Median seconds of `copy` and of `fn`, run alternately `REPEATS` times after a warm-up."""
    fn()
    copy()
    t_fn, t_copy = [], []
    for _ in range(REPEATS):
        start = time.perf_counter()
        copy()
        t_copy.append(time.perf_counter() - start)
        start = time.perf_counter()
        fn()
        t_fn.append(time.perf_counter() - start)
    return statistics.median(t_copy), statistics.median(t_fn)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        match = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.MULTILINE)
    return int(match.group(1)) if match else 0


def peak_rss_above(fn: Callable[[], object]) -> float:
    """MiB by which the peak resident set during `fn` exceeds the resident set before it;
    a platform where the peak cannot be reset (outside Linux) is an error, not a blank."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
    except OSError as exc:
        raise SystemExit(
            f"peak memory needs Linux's /proc/self/clear_refs ({exc}); run this part on Linux"
        ) from exc
    before = _status_kib("VmRSS")
    fn()
    return (_status_kib("VmHWM") - before) / 1024


def tiny_ffa_update(rank: int = 8) -> dict[str, torch.Tensor]:
    """The B matrices (out, r) an FFA-LoRA client of the tiny model sends."""
    model = build_tiny_model(vocab_size=512)
    gen = torch.Generator().manual_seed(1)
    return {
        update_key(module): torch.randn(out, rank, generator=gen)
        for module, (out, _) in target_weights(model, LoraSpec(rank=rank)).items()
    }


def tiny_dense_delta() -> dict[str, torch.Tensor]:
    """A full-weight delta of the tiny model (every parameter, as full fine-tuning sends)."""
    model = build_tiny_model(vocab_size=512)
    gen = torch.Generator().manual_seed(2)
    return {k: torch.randn(v.shape, generator=gen) for k, v in model.state_dict().items()}


def lora_like() -> dict[str, torch.Tensor]:
    """FFA-LoRA B matrices (2048, 16) of a 24-layer, hidden-2048 model (q, k, v, o, 192 B's
    and the same number of A-shaped (16, 2048) tensors, as a non-FFA LoRA client would send)."""
    gen = torch.Generator().manual_seed(3)
    delta = {}
    for layer in range(24):
        for proj in ("q", "k", "v", "o"):
            delta[f"l{layer}.{proj}.lora_A"] = torch.randn(16, 2048, generator=gen)
            delta[f"l{layer}.{proj}.lora_B"] = torch.randn(2048, 16, generator=gen)
    return delta


def square() -> dict[str, torch.Tensor]:
    """One 4096 x 4096 float32 tensor."""
    return {"w": torch.randn(4096, 4096, generator=torch.Generator().manual_seed(0))}


def lora_b_small() -> dict[str, torch.Tensor]:
    """192 FFA-LoRA B matrices (896, 16): a rank-16 update of a 24-layer, hidden-896 model
    (q, k, v, o, gate, up, down, and one more per layer), as a 0.5B model's client sends."""
    gen = torch.Generator().manual_seed(4)
    return {f"l{i:03d}.lora_B": torch.randn(896, 16, generator=gen) for i in range(192)}


WORKLOADS: dict[str, Callable[[], dict[str, torch.Tensor]]] = {
    "4096x4096 fp32": square,
    "tiny FFA-LoRA B update (r 8)": tiny_ffa_update,
    "tiny dense delta": tiny_dense_delta,
    "LoRA r16, 24 x hidden 2048": lora_like,
}
GPU_ONLY_WORKLOADS: dict[str, Callable[[], dict[str, torch.Tensor]]] = {
    "LoRA B (896, 16) x 192": lora_b_small,
}


def throughput_rows(name: str, delta: dict[str, torch.Tensor]) -> list[str]:
    tensors = [t.reshape(-1) for t in delta.values()]
    ns = [t.numel() for t in tensors]
    copies = [torch.empty_like(t) for t in tensors]
    packed, scales = bitdelta.pack_many(tensors, GROUP)
    out = torch.empty(sum(ns))
    layout = layout_of(delta)
    payload = encode(delta, CodecSpec("bitdelta", group_size=GROUP))
    nbytes = 4 * sum(ns)

    def copy() -> None:
        for dst, src in zip(copies, tensors, strict=True):
            dst.copy_(src)

    ops: dict[str, Callable[[], object]] = {
        "pack": lambda: bitdelta.pack_many(tensors, GROUP),
        "unpack": lambda: bitdelta.unpack_many(packed, scales, ns, GROUP, out),
        "encode": lambda: encode(delta, CodecSpec("bitdelta", group_size=GROUP)),
        "decode_into": lambda: decode_into(payload, out, layout, max_elements=numel(layout)),
    }
    rows = []
    for label, fn in ops.items():
        t_copy, t = ratio_to_copy(fn, copy)
        rows.append(
            f"| {name} | {len(tensors)} | {label} | {t * 1e3:.3f} | {t_copy * 1e3:.3f} "
            f"| {nbytes / t / 1e9:.2f} | {t_copy / t:.2f} |"
        )
    return rows


def stage_rows(name: str, delta: dict[str, torch.Tensor]) -> list[str]:
    """Rows timing the stages of `encode` (float32 CPU tensors), each against the copy anchor.

    ``table``, ``pack_concat`` (signs and scales) and ``SHA-256`` (of the payload) are the
    encoder's own steps. ``compiled pass`` is the fused C pass alone (`_bitpack.pack` of every
    tensor's flat array into preallocated buffers: the one read of the input), without the
    per-tensor Python work of ``pack_concat``; ``pack_concat, numpy path`` is the fallback
    used where the extension was not built. Without the extension those two rows are left out.
    """
    names = sorted(delta)
    tensors = [delta[k] for k in names]
    flats = [t.reshape(-1).numpy() for t in tensors]
    copies = [torch.empty_like(t) for t in tensors]
    spec = CodecSpec("bitdelta", group_size=GROUP)
    payload = encode(delta, spec)
    bits = np.empty(sum((f.size + 7) // 8 for f in flats), dtype=np.uint8)
    sums = np.empty(sum(-(-f.size // GROUP) for f in flats), dtype=np.float32)

    def copy() -> None:
        for dst, src in zip(copies, tensors, strict=True):
            dst.copy_(src)

    def compiled_pass() -> None:
        pack = importlib.import_module("zoo_gym.compression._bitpack").pack
        at = first = 0
        for x in flats:
            pack(x, GROUP, bits, at, sums, first)
            at, first = at + (x.size + 7) // 8, first + -(-x.size // GROUP)

    def numpy_path() -> None:
        previous = bitdelta.use_compiled(False)
        try:
            bitdelta.pack_concat(tensors, GROUP)
        finally:
            bitdelta.use_compiled(previous)

    stages: dict[str, Callable[[], object]] = {
        "encode": lambda: encode(delta, spec),
        "table": lambda: envelope._table(names, tensors, spec),
        "pack_concat": lambda: bitdelta.pack_concat(tensors, GROUP),
        "compiled pass": compiled_pass,
        "pack_concat, numpy path": numpy_path,
        "SHA-256": lambda: hashlib.sha256(memoryview(payload)[:-32]).digest(),
    }
    if not bitdelta.compiled_available():
        del stages["compiled pass"], stages["pack_concat, numpy path"]
    rows = []
    for label, fn in stages.items():
        t_copy, t = ratio_to_copy(fn, copy)
        rows.append(f"| {name} | {label} | {t * 1e3:.3f} | {t_copy * 1e3:.3f} | {t_copy / t:.2f} |")
    return rows


def _synchronised(fn: Callable[[], object], device: str) -> Callable[[], None]:
    def run() -> None:
        fn()
        if device == "cuda":
            torch.cuda.synchronize()

    return run


def gpu_rows(name: str, delta: dict[str, torch.Tensor], device: str = "cuda") -> list[str]:
    """The GPU table's rows for one workload (see the module docstring); `device` "cpu" runs
    the same code in the Triton interpreter, as a check of this function only."""
    from zoo_gym.compression.kernels import bitdelta_triton

    on_gpu = {k: v.to(device) for k, v in delta.items()}
    tensors = [t.reshape(-1) for t in on_gpu.values()]
    copies = [torch.empty_like(t) for t in tensors]
    bits = [torch.empty((t.numel() + 7) // 8, dtype=torch.uint8, device=device) for t in tensors]
    scales = [torch.empty(-(-t.numel() // GROUP), device=device) for t in tensors]
    outs = [torch.empty_like(t) for t in tensors]
    spec = CodecSpec("bitdelta", group_size=GROUP)
    payload = encode(on_gpu, spec)
    layout = layout_of(delta)
    row = torch.empty(numel(layout), device=device)
    nbytes = 4 * sum(t.numel() for t in tensors)

    def copy() -> None:
        for dst, src in zip(copies, tensors, strict=True):
            dst.copy_(src)

    def pack() -> None:
        for x, b, s in zip(tensors, bits, scales, strict=True):
            bitdelta_triton.pack(x, b, s, GROUP)

    def unpack() -> None:
        for b, s, out in zip(bits, scales, outs, strict=True):
            bitdelta_triton.unpack(b, s, out, GROUP, 1.0, False)

    ops: dict[str, Callable[[], object]] = {
        "pack": pack,
        "unpack": unpack,
        "encode": lambda: encode(on_gpu, spec),
        "decode_into": lambda: decode_into(payload, row, layout, max_elements=numel(layout)),
    }
    rows = []
    for label, fn in ops.items():
        t_copy, t = ratio_to_copy(_synchronised(fn, device), _synchronised(copy, device))
        rows.append(
            f"| {name} | {len(tensors)} | {label} | {t * 1e3:.3f} | {t_copy * 1e3:.3f} "
            f"| {nbytes / t / 1e9:.1f} | {nbytes / t_copy / 1e9:.1f} | {t_copy / t:.2f} |"
        )
    return rows


def print_gpu_section(workloads: dict[str, dict[str, torch.Tensor]]) -> None:
    if not (torch.cuda.is_available() and kernels.available()):
        print("GPU section skipped: no CUDA device or no Triton here.")
        return
    print(f"GPU: {torch.cuda.get_device_name()}, Triton kernels, median of {REPEATS}")
    print()
    print("| tensors | count | op | ms | copy_ ms | fp32 GB/s | copy_ GB/s | vs copy |")
    print("|---|---|---|---|---|---|---|---|")
    for name in ("4096x4096 fp32", "LoRA r16, 24 x hidden 2048", "LoRA B (896, 16) x 192"):
        for row in gpu_rows(name, workloads[name]):
            print(row)
    print()


def memory_probe(name: str, op: str) -> None:
    """Print the MiB by which one `op` call on workload `name` raises the peak RSS."""
    delta = WORKLOADS[name]()
    tensors = [t.reshape(-1) for t in delta.values()]
    if op == "pack":
        extra = peak_rss_above(lambda: bitdelta.pack_many(tensors, GROUP))
    else:
        extra = peak_rss_above(lambda: encode(delta, CodecSpec("bitdelta", group_size=GROUP)))
    print(f"{extra:.2f}")


def memory_rows(name: str, delta: dict[str, torch.Tensor], threads: int) -> list[str]:
    mib = 4 * sum(t.numel() for t in delta.values()) / 2**20
    rows = []
    for op in ("pack", "encode"):
        argv = [sys.executable, __file__, "--threads", str(threads), "--probe", name, op]
        out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout.strip()
        shown = f"{float(out):.1f} ({float(out) / mib:.3f}x)"
        rows.append(f"| {name} | {op} | {mib:.1f} | {shown} |")
    return rows


def size_rows(delta: dict[str, torch.Tensor]) -> list[str]:
    values = sum(t.numel() for t in delta.values())
    rows = []
    for codec in CODECS:
        size = len(encode(delta, CodecSpec(codec, group_size=GROUP)))
        rows.append(f"| {codec} | {size} | {8 * size / values:.3f} | {2 * values / size:.2f}x |")
    return rows


def cpu_pack() -> str:
    """Which CPU pack `pack_concat` runs for group GROUP."""
    if not bitdelta.compiled_available():
        return "numpy path (the C extension was not built)"
    kernel = importlib.import_module("zoo_gym.compression._bitpack").kernels[-1]
    return f"compiled pass, {kernel} kernel"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (anchor too)"
    )
    parser.add_argument("--gpu-only", action="store_true", help="only the GPU table")
    parser.add_argument("--stages", action="store_true", help="only the encode stage table")
    parser.add_argument("--probe", nargs=2, help=argparse.SUPPRESS)  # workload, op: see memory_rows
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.probe:
        memory_probe(*args.probe)
        return
    torch.manual_seed(0)
    workloads = {name: build() for name, build in WORKLOADS.items()}
    if args.stages:
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, median of {REPEATS}")
        print(f"CPU pack: {cpu_pack()}")
        print()
        print("| tensors | stage | ms | copy_ ms | copy / stage |")
        print("|---|---|---|---|---|")
        for name in ("4096x4096 fp32", "LoRA r16, 24 x hidden 2048"):
            for row in stage_rows(name, workloads[name]):
                print(row)
        return
    if args.gpu_only:
        workloads |= {name: build() for name, build in GPU_ONLY_WORKLOADS.items()}
        print_gpu_section(workloads)
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, median of {REPEATS}")
    print(f"CPU pack: {cpu_pack()}")
    print()
    print("| tensors | count | op | ms | copy_ ms | fp32 GB/s | vs copy |")
    print("|---|---|---|---|---|---|---|")
    for name, delta in workloads.items():
        for row in throughput_rows(name, delta):
            print(row)
    print()
    print("| tensors | op | input MiB | peak RSS above start, MiB (x input) |")
    print("|---|---|---|---|")
    for name in ("4096x4096 fp32", "LoRA r16, 24 x hidden 2048"):
        for row in memory_rows(name, workloads[name], args.threads):
            print(row)
    print()
    for name in ("tiny dense delta", "LoRA r16, 24 x hidden 2048"):
        delta = workloads[name]
        values = sum(t.numel() for t in delta.values())
        print(f"Compressed size, group {GROUP}, {name} ({values} values):")
        print()
        print("| codec | bytes | bits/value | vs bf16 |")
        print("|---|---|---|---|")
        for row in size_rows(delta):
            print(row)
        print()
    workloads |= {name: build() for name, build in GPU_ONLY_WORKLOADS.items()}
    print_gpu_section(workloads)


if __name__ == "__main__":
    main()
