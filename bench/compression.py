"""Throughput of BitDelta pack/unpack against a plain copy, and compressed sizes versus bf16.

Run: python bench/compression.py. Prints medians of repeated runs; the anchor is
`torch.Tensor.copy_` of the same float32 bytes, measured in the same run.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from zoo_gym.compression import CODECS, CodecSpec, bitdelta, encode

REPEATS = 15


def median_seconds(fn: Callable[[], object]) -> float:
    fn()
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def lora_like() -> dict[str, torch.Tensor]:
    """A rank-16 LoRA update of a 24-layer, hidden-2048 model (q, k, v, o projections)."""
    delta = {}
    for layer in range(24):
        for proj in ("q", "k", "v", "o"):
            delta[f"l{layer}.{proj}.lora_A"] = torch.randn(16, 2048)
            delta[f"l{layer}.{proj}.lora_B"] = torch.randn(2048, 16)
    return delta


def throughput_rows(name: str, tensors: list[torch.Tensor]) -> list[str]:
    group = 128
    copies = [torch.empty_like(t) for t in tensors]
    packed = [bitdelta.pack(t.view(-1), group) for t in tensors]
    outs = [torch.empty(t.numel()) for t in tensors]
    nbytes = sum(t.numel() * 4 for t in tensors)

    def copy() -> None:
        for dst, src in zip(copies, tensors, strict=True):
            dst.copy_(src)

    def pack() -> None:
        for t in tensors:
            bitdelta.pack(t.view(-1), group)

    def unpack() -> None:
        for (bits, scales), out in zip(packed, outs, strict=True):
            bitdelta.unpack(bits, scales, group, out)

    t_copy = median_seconds(copy)
    rows = []
    for label, fn in (("copy_", copy), ("pack", pack), ("unpack", unpack)):
        t = t_copy if label == "copy_" else median_seconds(fn)
        rows.append(
            f"{name:<22} {label:<8} {t * 1e3:9.2f} ms {nbytes / t / 1e9:8.2f} GB/s {t_copy / t:7.2f}"
        )
    return rows


def main() -> None:
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, median of {REPEATS}")
    print(f"{'tensors':<22} {'op':<8} {'time':>12} {'fp32 GB/s':>13} {'vs copy':>7}")
    big = torch.randn(4096, 4096)
    for row in throughput_rows("4096x4096 fp32", [big]):
        print(row)
    lora = lora_like()
    for row in throughput_rows(f"LoRA r16 ({len(lora)} tensors)", list(lora.values())):
        print(row)
    print()
    print(f"{'codec':<10} {'bytes':>12} {'bits/value':>11} {'vs bf16':>8}   (LoRA-like delta)")
    values = sum(t.numel() for t in lora.values())
    for codec in CODECS:
        size = len(encode(lora, CodecSpec(codec, group_size=128)))
        print(f"{codec:<10} {size:>12} {8 * size / values:>11.3f} {2 * values / size:>7.2f}x")


if __name__ == "__main__":
    main()
