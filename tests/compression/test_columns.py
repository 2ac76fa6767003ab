"""PayloadColumns: column ranges decoded from envelopes equal `decode_into`'s values, every
rule run from payloads equals the rule on the decoded `(n, d)` tensor, and memory follows
n x chunk width, not n x d."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from zoo_gym.aggregation import RULES, aggregate
from zoo_gym.compression import CODECS, CodecSpec, EnvelopeError, decode_into, encode
from zoo_gym.compression.columns import PayloadColumns
from zoo_gym.core.delta import Layout, layout_of

MAX = 10**8
PARAMS: dict[str, dict[str, Any]] = {"centered_clipping": {"tau": 1.0}}
EXACT = {"fedavg", "krum", "multikrum", "bulyan", "median", "trimmed_mean"}


def payloads(n: int, spec: CodecSpec, seed: int = 0) -> tuple[list[bytes], Layout]:
    g = torch.Generator().manual_seed(seed)
    deltas = [
        {
            "a.weight": torch.randn(5, 13, generator=g) * (3.0 if i < 2 else 1.0),
            "b.bias": torch.randn(37, generator=g),
            "c.weight": torch.randn(3, 9, generator=g),
        }
        for i in range(n)
    ]
    return [encode(d, spec) for d in deltas], layout_of(deltas[0])


def decoded(blobs: list[bytes], layout: Layout) -> torch.Tensor:
    d = sum(ts.numel for ts in layout)
    out = torch.empty(len(blobs), d)
    for i, blob in enumerate(blobs):
        decode_into(blob, out[i], layout, max_elements=MAX)
    return out


SPECS = [
    CodecSpec(codec, 16, granularity, "float16")
    for codec in CODECS
    for granularity in ("group", "row", "matrix")
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.codec}-{s.granularity}")
def test_every_range_equals_decode_into(spec: CodecSpec) -> None:
    blobs, layout = payloads(4, spec)
    full = decoded(blobs, layout)
    source = PayloadColumns(blobs, layout, max_elements=MAX, budget=1000)
    d = full.shape[1]
    for width in (1, 3, 8, 50, d):
        for start in range(0, d, width):
            stop = min(d, start + width)
            assert torch.equal(source.columns(start, stop), full[:, start:stop])
            assert torch.equal(source.columns(start, stop, [3, 0]), full[[3, 0], start:stop])


@pytest.mark.parametrize("scale_dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("group", [1, 12, 64])
def test_bitdelta_ranges_cut_through_bytes_and_groups(scale_dtype: str, group: int) -> None:
    g = torch.Generator().manual_seed(group)
    shapes = {"a": (3, 333), "b": (7,), "c": (2, 517), "d": (1,)}
    deltas = [{k: torch.randn(s, generator=g) for k, s in shapes.items()} for _ in range(5)]
    blobs = [encode(x, CodecSpec("bitdelta", group, "group", scale_dtype)) for x in deltas]
    layout = layout_of(deltas[0])
    full = decoded(blobs, layout)
    source = PayloadColumns(blobs, layout, max_elements=MAX, budget=1000)
    d = full.shape[1]
    cuts = torch.randint(0, d + 1, (60, 2), generator=g).sort(dim=1).values.tolist()
    for start, stop in [*cuts, (0, d), (5, 6), (999, 1001), (d - 3, d), (1006, 1007)]:
        assert torch.equal(source.columns(start, stop), full[:, start:stop])
        assert torch.equal(source.columns(start, stop, [4, 1, 1]), full[[4, 1, 1], start:stop])


def test_payloads_of_different_group_sizes_decode_one_by_one() -> None:
    blobs, layout = payloads(2, CodecSpec("bitdelta", 16))
    other, _ = payloads(2, CodecSpec("bitdelta", 8), seed=1)
    mixed = [blobs[0], other[0], blobs[1]]
    source = PayloadColumns(mixed, layout, max_elements=MAX, budget=1000)
    assert torch.equal(source.columns(3, 101), decoded(mixed, layout)[:, 3:101])


@pytest.mark.parametrize(
    ("specs", "offered"),
    [
        ([CodecSpec("bitdelta", 16)], True),
        ([CodecSpec("bitdelta", 16, "row")], True),
        ([CodecSpec("bitdelta", 16, "group", "float32")], False),
        ([CodecSpec("bitdelta", 16, "group", "bfloat16")], False),
        ([CodecSpec("bitdelta", 16), CodecSpec("bitdelta", 8)], False),
        ([CodecSpec("fp16", 16)], False),
    ],
    ids=["float16", "rows", "float32", "bfloat16", "two-groups", "fp16"],
)
def test_whether_payloads_offer_sign_groups_is_known_from_their_headers(
    specs: list[CodecSpec], offered: bool
) -> None:
    blobs = [blob for i, spec in enumerate(specs) for blob in payloads(2, spec, seed=i)[0]]
    layout = payloads(1, specs[0])[1]
    headers = [PayloadColumns.check(blob, layout, MAX) for blob in blobs]
    source = PayloadColumns(blobs, layout, max_elements=MAX, budget=1000, headers=headers)
    assert PayloadColumns.offers_sign_groups(headers) is offered
    assert (source.sign_groups(0, 5) is not None) is offered


# 4000 bytes: chunks of a few columns; 1 MiB: multi-pass rules decode everything once
@pytest.mark.parametrize("budget", [4000, 1 << 20])
@pytest.mark.parametrize("rule", sorted(RULES))
def test_every_rule_from_payloads_equals_the_decoded_tensor(rule: str, budget: int) -> None:
    blobs, layout = payloads(11, CodecSpec("bitdelta", 8))
    x = decoded(blobs, layout)
    source = PayloadColumns(blobs, layout, max_elements=MAX, budget=budget)
    a = aggregate(rule, x, f=2, **PARAMS.get(rule, {}))
    b = aggregate(rule, source, f=2, **PARAMS.get(rule, {}))
    if rule in EXACT:
        assert torch.equal(a.vector, b.vector)
    else:
        assert torch.allclose(a.vector, b.vector, rtol=1e-5, atol=1e-6)
    for p, q in zip(a.decisions, b.decisions, strict=True):
        assert p.selected == q.selected
        assert p.weight == pytest.approx(q.weight, rel=1e-5, abs=1e-9)
        assert p.trimmed_share == pytest.approx(q.trimmed_share, rel=1e-5, abs=1e-9)


def test_bad_payloads_are_refused_up_front() -> None:
    blobs, layout = payloads(3, CodecSpec("bitdelta", 8))
    other, other_layout = payloads(1, CodecSpec("bitdelta", 8))
    corrupt = bytearray(blobs[1])
    corrupt[-40] ^= 1
    with pytest.raises(EnvelopeError, match="SHA-256"):
        PayloadColumns([blobs[0], bytes(corrupt)], layout, max_elements=MAX, budget=100)
    with pytest.raises(EnvelopeError, match="differ from the layout"):
        PayloadColumns(blobs, other_layout[:2], max_elements=MAX, budget=100)
    assert other


def _rss() -> int:
    """Resident set size of this process in bytes."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * 4096


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs /proc")
def test_memory_follows_the_chunk_not_n_times_d() -> None:
    n, d = 16, 2_000_000  # decoded: 128 MB; payloads: 4.5 MB
    spec = CodecSpec("bitdelta", 128)
    g = torch.Generator().manual_seed(0)
    blobs = [encode({"w": torch.randn(d, generator=g)}, spec) for _ in range(n)]
    layout = layout_of({"w": torch.empty(d)})
    budget = 4 << 20
    source = PayloadColumns(blobs, layout, max_elements=MAX, budget=budget)
    widths: list[int] = []
    inner = source.columns

    def counted(start: int, stop: int, rows: Any = None) -> torch.Tensor:
        widths.append(stop - start)
        return inner(start, stop, rows)

    source.columns = counted  # type: ignore[method-assign]
    aggregate("median", source)  # warm up allocator and thread pools
    base, peak, done = _rss(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        for rule, params in [("fedavg", {}), ("krum", {"f": 2}), ("trimmed_mean", {"f": 2})]:
            aggregate(rule, source, **params)
    finally:
        done.set()
        sampler.join()
    assert max(widths) * n * 4 <= budget  # every chunk within the budget
    # the (d,) outputs and accumulators (8 MB each) plus chunks, far from n x d = 128 MB
    assert peak[0] - base < 48 << 20
