"""PayloadColumns with the sign bytes and scales held on the device: every column range and
every rule equals the host decode's, bit for bit. The CPU runs the same torch path with
`resident=True`; the `gpu` tests run it on CUDA."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from zoo_gym.aggregation import RULES, aggregate
from zoo_gym.compression import CodecSpec, encode
from zoo_gym.compression.columns import PayloadColumns
from zoo_gym.core.delta import Layout, layout_of

MAX = 10**8
PARAMS: dict[str, dict[str, Any]] = {"centered_clipping": {"tau": 1.0}}
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, CUDA])]
# numel not a multiple of 8, groups that do not divide a row, tensors of one value
SHAPES = {"a": (3, 333), "b": (7,), "c": (2, 517), "d": (1,), "e": (41, 3)}


def payloads(n: int, group: int, scale_dtype: str, seed: int = 0) -> tuple[list[bytes], Layout]:
    g = torch.Generator().manual_seed(seed)
    spec = CodecSpec("bitdelta", group, "group", scale_dtype)
    deltas = [
        {k: torch.randn(s, generator=g) * (1 + i) for k, s in SHAPES.items()} for i in range(n)
    ]
    return [encode(x, spec) for x in deltas], layout_of(deltas[0])


def sources(
    blobs: list[bytes], layout: Layout, device: str, budget: int
) -> tuple[PayloadColumns, PayloadColumns]:
    """(host decode moved to `device`, signs and scales held on `device`)."""
    host = PayloadColumns(
        blobs, layout, max_elements=MAX, budget=budget, device=device, resident=False
    )
    held = PayloadColumns(
        blobs, layout, max_elements=MAX, budget=budget, device=device, resident=True
    )
    assert not host.resident and held.resident
    return host, held


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scale_dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("group", [1, 12, 64, 128])
def test_resident_ranges_equal_the_host_decode(device: str, scale_dtype: str, group: int) -> None:
    blobs, layout = payloads(6, group, scale_dtype, seed=group)
    host, held = sources(blobs, layout, device, budget=7)  # host slabs of 7 bytes
    d = host.d
    g = torch.Generator().manual_seed(group)
    cuts = torch.randint(0, d + 1, (80, 2), generator=g).sort(dim=1).values.tolist()
    # inside one byte; from inside a byte and a group across tensor ends; empty; whole rows
    fixed = [(0, d), (5, 6), (3, 1010), (999, 1001), (1006, 1007), (d - 3, d), (20, 20), (0, 1)]
    for start, stop in [*cuts, *fixed]:
        expected = host.columns(start, stop)
        got = held.columns(start, stop)
        assert got.device.type == device
        assert torch.equal(got, expected)
        some = [5, 1, 1, 0]
        assert torch.equal(held.columns(start, stop, some), host.columns(start, stop, some))
    assert held.columns(10, 30, []).shape == (0, 20)


@pytest.mark.parametrize("device", DEVICES)
def test_resident_values_equal_the_decoded_payloads(device: str) -> None:
    blobs, layout = payloads(3, 16, "float16")
    _, held = sources(blobs, layout, device, budget=1 << 20)
    host = PayloadColumns(blobs, layout, max_elements=MAX, budget=1 << 20)
    full = held.columns(0, held.d).cpu()
    assert torch.equal(full, host.columns(0, host.d))
    # signs times scales: every value of a group has one magnitude, its scale
    first = full[0, :16].abs()
    assert torch.all(first == first[0]) and first[0] > 0


def test_a_layout_not_all_bitdelta_keeps_the_host_path() -> None:
    g = torch.Generator().manual_seed(3)
    deltas = [
        {"a": torch.randn(37, generator=g), "b": torch.randn(20, generator=g)} for _ in range(4)
    ]
    spec, own = CodecSpec("bitdelta", 8), {"b": CodecSpec("int8", 8)}
    blobs = [encode(x, spec, own=own) for x in deltas]
    layout = layout_of(deltas[0])
    mixed = PayloadColumns(blobs, layout, max_elements=MAX, budget=100, resident=True)
    host = PayloadColumns(blobs, layout, max_elements=MAX, budget=100)
    assert not mixed.resident
    assert torch.equal(mixed.columns(3, 50, [2, 0]), host.columns(3, 50, [2, 0]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("budget", [4000, 1 << 20])
@pytest.mark.parametrize("rule", sorted(RULES))
def test_every_rule_from_a_resident_source_equals_the_host_source(
    device: str, rule: str, budget: int
) -> None:
    blobs, layout = payloads(11, 8, "float16")
    host, held = sources(blobs, layout, device, budget)
    params = {"f": 2, **PARAMS.get(rule, {})}
    a = aggregate(rule, host, **params)
    b = aggregate(rule, held, **params)
    assert b.vector.device.type == device
    assert torch.equal(a.vector, b.vector)
    assert a.decisions == b.decisions


@pytest.mark.gpu
@CUDA
def test_signs_that_do_not_fit_on_the_gpu_fall_back_to_the_host_decode(
    caplog: pytest.LogCaptureFixture,
) -> None:
    g = torch.Generator().manual_seed(0)
    blobs = [
        encode({"w": torch.randn(1 << 26, generator=g)}, CodecSpec("bitdelta", 128))
        for _ in range(4)
    ]
    layout = layout_of({"w": torch.empty(1 << 26)})
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    # the limit counts what the allocator holds from the device (its blocks, not the tensors
    # in them): 32 MiB of signs against 24 MiB to spare, of which the sign table takes a
    # block of 2 MiB and a chunk copied there another; chunks of 64 KiB
    spare = torch.cuda.memory_reserved() + (24 << 20)
    torch.cuda.set_per_process_memory_fraction(spare / total)
    try:
        with caplog.at_level(logging.WARNING, logger="zoo_gym.compression.columns"):
            source = PayloadColumns(blobs, layout, max_elements=MAX, budget=1 << 16, device="cuda")
        chunk = source.columns(1000, 3000, [3, 1])
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert not source.resident
    assert [r.message for r in caplog.records] == [
        "the payloads' signs and scales do not fit in cuda memory: decoding column chunks on "
        "the CPU and copying them there instead"
    ]
    host = PayloadColumns(blobs, layout, max_elements=MAX, budget=1 << 16)
    assert chunk.device.type == "cuda"
    assert torch.equal(chunk.cpu(), host.columns(1000, 3000, [3, 1]))
