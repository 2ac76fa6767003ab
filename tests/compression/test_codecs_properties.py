import hypothesis.strategies as st
import numpy as np
import torch
from hypothesis import example, given, settings

from zoo_gym.compression import (
    CodecSpec,
    EnvelopeError,
    bitdelta,
    decode,
    decode_accumulate,
    decode_into,
    encode,
    inspect_envelope,
)
from zoo_gym.core.delta import layout_of

values = st.lists(st.floats(-100, 100, allow_nan=False, width=32), min_size=0, max_size=300).map(
    lambda xs: torch.tensor(xs, dtype=torch.float32)
)
groups = st.sampled_from([1, 3, 8, 16, 128])
LEVEL = {"int8": 127, "int4": 7, "int2": 3, "ternary": 1}


def _group_max(x: torch.Tensor, group: int) -> torch.Tensor:
    return bitdelta.group_reduce(x, group, ord=float("inf")).repeat_interleave(group)[: x.numel()]


@settings(max_examples=60, deadline=None)
@given(x=values, group=groups, codec=st.sampled_from(["int8", "int4", "int2", "ternary"]))
def test_quantiser_error_bound(x: torch.Tensor, group: int, codec: str) -> None:
    spec = CodecSpec(codec, group_size=group, scale_dtype="float32")

    y = decode(encode({"x": x}, spec), max_elements=x.numel())["x"]

    step = _group_max(x, group) / LEVEL[codec]
    bound = step * (1.0 if codec == "int2" else 0.5) * (1 + 1e-5) + 1e-30
    assert bool(((y - x).abs() <= bound).all())


@settings(max_examples=60, deadline=None)
@given(x=values, group=groups)
@example(x=torch.tensor([0.0, -1.4e-45]), group=3)  # the group's mean |x| underflows to 0
def test_bitdelta_signs_and_l2_optimal_scales(x: torch.Tensor, group: int) -> None:
    spec = CodecSpec("bitdelta", group_size=group, scale_dtype="float32")

    y = decode(encode({"x": x}, spec), max_elements=x.numel())["x"]

    mean_abs = bitdelta.group_reduce(x, group, ord=1).repeat_interleave(group)[: x.numel()]
    assert torch.allclose(y.abs(), mean_abs, rtol=1e-5, atol=0)
    # signs survive wherever the scale does; a group whose mean |x| is below float32's
    # smallest subnormal decodes to zeros, within 1e-45 of its values
    kept = mean_abs > 0
    assert torch.equal((y >= 0)[kept], (x >= 0)[kept])
    assert bool((y[~kept] == 0).all())


@settings(max_examples=40, deadline=None)
@given(x=values)
def test_pack_signs_matches_numpy_packbits(x: torch.Tensor) -> None:
    packed, _ = bitdelta.pack(x, 8)

    assert packed.numpy().tobytes() == np.packbits(x.numpy() >= 0).tobytes()
    assert torch.equal(bitdelta.pack_signs(x), packed)
    assert torch.equal(bitdelta.unpack_signs(packed, x.numel()), x >= 0)


PAYLOADS = [
    encode({"a": torch.randn(3, 5), "b": torch.randn(17)}, CodecSpec(codec, group_size=4))
    for codec in ["bitdelta", "int4", "ternary", "int2", "none"]
]


@settings(max_examples=300, deadline=None)
@given(
    which=st.integers(0, len(PAYLOADS) - 1),
    edits=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=4),
    cut=st.integers(0, 10**6),
    rehash=st.booleans(),
)
def test_mutated_bytes_only_raise_envelope_error(
    which: int, edits: list[tuple[int, int]], cut: int, rehash: bool
) -> None:
    import hashlib

    data = bytearray(PAYLOADS[which])
    for position, value in edits:
        data[position % len(data)] = value
    data = data[: max(len(data) - cut % 8, 0)] if cut % 3 == 0 else data
    if rehash and len(data) > 32:
        data[-32:] = hashlib.sha256(bytes(data[:-32])).digest()

    try:
        decoded = decode(bytes(data), max_elements=40)
    except EnvelopeError as exc:
        assert "\n" not in str(exc)
    else:
        assert sum(t.numel() for t in decoded.values()) <= 40
        assert all(bool(torch.isfinite(t).all()) for t in decoded.values())
    for consume in (_decode_into, _accumulate):  # the coordinator's batched paths
        try:
            out = consume(bytes(data))
        except EnvelopeError as exc:
            assert "\n" not in str(exc)
        else:
            assert bool(torch.isfinite(out).all())


LAYOUT = layout_of({"a": torch.zeros(3, 5), "b": torch.zeros(17)})


def _decode_into(payload: bytes) -> torch.Tensor:
    out = torch.zeros(32)
    decode_into(payload, out, LAYOUT, max_elements=40)
    return out


def _accumulate(payload: bytes) -> torch.Tensor:
    out = torch.zeros(32)
    decode_accumulate([payload, payload], [0.5, 0.5], out, LAYOUT, max_elements=40)
    return out


@settings(max_examples=100, deadline=None)
@given(shape=st.lists(st.integers(0, 2**62), min_size=1, max_size=3))
def test_declared_sizes_checked_before_allocation(shape: list[int]) -> None:
    import hashlib
    import struct

    body = bytearray(encode({"w": torch.randn(4)}, CodecSpec("bitdelta", group_size=4))[:-32])
    table = struct.pack("<BB", 0, len(shape)) + struct.pack(f"<{len(shape)}Q", *shape)
    body = body[:23] + table + body[33:]
    payload = bytes(body) + hashlib.sha256(bytes(body)).digest()

    try:
        header = inspect_envelope(payload, max_elements=1000)
    except EnvelopeError:
        return
    assert header.total_elements <= 1000


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.sampled_from([0, 1, 7, 8, 64, 128, 136, 300, 1024]), max_size=8),
    group=groups,
    weight=st.sampled_from([None, 0.37]),
)
def test_many_tensors_pack_and_unpack_like_one_at_a_time(
    sizes: list[int], group: int, weight: float | None
) -> None:
    gen = torch.Generator().manual_seed(len(sizes) * 1000 + group)
    xs = [torch.randn(n, generator=gen) for n in sizes]

    packed, scales = bitdelta.pack_many(xs, group)

    alone = [bitdelta.pack(x, group) for x in xs]
    assert all(torch.equal(p, a) for p, (a, _) in zip(packed, alone, strict=True))
    assert torch.equal(scales, torch.cat([s for _, s in alone] + [torch.empty(0)]))
    out = torch.full((sum(sizes),), 0.5)
    bitdelta.unpack_many(packed, scales, sizes, group, out, weight=weight)
    expected = torch.full((sum(sizes),), 0.5)
    offset = 0
    for x, (_, s) in zip(xs, alone, strict=True):
        target = expected[offset : offset + x.numel()]
        if weight is None:
            target.copy_(torch.where(x >= 0, 1.0, -1.0) * s.repeat_interleave(group)[: x.numel()])
        else:
            target.add_(
                torch.where(x >= 0, 1.0, -1.0) * (s * weight).repeat_interleave(group)[: x.numel()]
            )
        offset += x.numel()
    assert torch.equal(out, expected)
