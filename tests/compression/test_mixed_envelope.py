"""Version 3 envelopes: a codec per tensor. Every reader decodes each tensor as decoding that
tensor alone in its codec does; version 2 bytes stay as they were; hostile tables are refused
in one line before anything is allocated."""

from __future__ import annotations

import hashlib
import math
import struct
import zlib
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zoo_gym.compression import (
    CODECS,
    CodecSpec,
    EnvelopeError,
    apply_update_,
    decode,
    decode_accumulate,
    decode_into,
    encode,
    envelope_norm,
    honest_norm_bound,
    inspect_envelope,
)
from zoo_gym.compression.columns import PayloadColumns
from zoo_gym.compression.norms import codec_growth, feedback_cap
from zoo_gym.compression.spec import GRANULARITIES, SCALE_DTYPES
from zoo_gym.core.delta import Delta, layout_of, numel

MAX = 10**6
HEAD = 20  # magic to tensor count
SPEC = CodecSpec("bitdelta", group_size=16)
OWN = {
    "a.lora_B_carry": CodecSpec("int8", group_size=16),
    "b.lora_B_carry": CodecSpec("none"),
    "c.weight": CodecSpec("bitdelta", granularity="row", scale_dtype="float32"),
    "d.bias": CodecSpec("fp16"),
}


def _delta(seed: int) -> Delta:
    """A module's B and carried B, and tensors of odd lengths, in several dtypes."""
    gen = torch.Generator().manual_seed(seed)
    shapes = {
        "a.lora_B": (24, 4),
        "a.lora_B_carry": (24, 4),
        "b.lora_B": (13, 4),
        "b.lora_B_carry": (13, 4),
        "c.weight": (5, 11),
        "d.bias": (7,),
    }
    return {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}


def _alone(delta: Delta, own: dict[str, CodecSpec]) -> Delta:
    """Each tensor decoded from an envelope of its own, in its codec."""
    return {
        name: decode(encode({name: t}, own.get(name, SPEC)), max_elements=MAX)[name]
        for name, t in delta.items()
    }


def _flat(delta: Delta) -> torch.Tensor:
    return torch.cat([delta[name].reshape(-1) for name in sorted(delta)])


def test_encode_writes_version_3_only_when_a_tensor_has_its_own_codec() -> None:
    delta = _delta(0)

    plain = encode(delta, SPEC)
    same = encode(delta, SPEC, own={"a.lora_B_carry": SPEC})
    mixed = encode(delta, SPEC, own=OWN)

    assert same == plain and struct.unpack_from("<H", plain, 4) == (2,)
    header = inspect_envelope(mixed, max_elements=MAX)
    assert header.version == 3 and header.mixed and header.spec == SPEC
    assert {s.spec.name: s.codec_spec for s in header.sections} == {
        name: OWN.get(name, SPEC) for name in sorted(delta)
    }
    assert not inspect_envelope(plain, max_elements=MAX).mixed


def test_the_version_3_table_is_version_2_with_each_codec_after_the_shape() -> None:
    # Prepare
    delta = {"a": torch.tensor([0.5, -1.5, 1.0, -2.0]), "b": torch.tensor([1.0, -0.5])}
    payload = encode(delta, CodecSpec("bitdelta", group_size=4), own={"b": CodecSpec("int8")})

    # Execute
    head = payload[:HEAD]
    (length,) = struct.unpack_from("<I", payload, HEAD)
    table = zlib.decompress(payload[HEAD + 4 : HEAD + 4 + length])

    # Assert: version 3 with the envelope's own codec (BitDelta, group 4, float16), 2 tensors;
    # per entry name, dtype, ndim, shape, then codec id, granularity id, group size, scale dtype
    assert head.hex() == "5a474445" "0300" "03" "00" "04000000" "00" "000000" "02000000"  # fmt: skip
    assert table.hex() == (
        "0100" "61" "00" "01" "0400000000000000" "03" "00" "04000000" "00"
        "0100" "62" "00" "01" "0200000000000000" "04" "00" "80000000" "00"
    )  # fmt: skip
    sections = payload[HEAD + 4 + length : -32]
    # a: fp16 scale 1.25, signs + - + -; b: fp16 scale 1/127, codes 127 and -64 (0xc0)
    assert sections.hex() == "003d" + "a0" + "0820" + "7fc0"
    assert decode(payload, max_elements=6)["b"].tolist() == pytest.approx(
        [127 * 0.0078735, -64 * 0.0078735], rel=1e-4
    )


specs = st.builds(
    CodecSpec,
    codec=st.sampled_from(CODECS),
    group_size=st.sampled_from([8, 16, 128]),
    granularity=st.sampled_from(GRANULARITIES),
    scale_dtype=st.sampled_from(SCALE_DTYPES),
)


@settings(max_examples=60, deadline=None)
@given(spec=specs, own=st.lists(st.none() | specs, min_size=6, max_size=6), seed=st.integers(0, 99))
def test_any_codec_per_tensor_decodes_as_each_tensor_alone(
    spec: CodecSpec, own: list[CodecSpec | None], seed: int
) -> None:
    delta = _delta(seed)
    chosen = {name: s for name, s in zip(sorted(delta), own, strict=True) if s is not None}
    payload = encode(delta, spec, own=chosen)
    layout = layout_of(delta)
    expected = _flat(
        {
            name: decode(encode({name: t}, chosen.get(name, spec)), max_elements=MAX)[name]
            for name, t in delta.items()
        }
    )

    row = torch.empty(numel(layout))
    decode_into(payload, row, layout, max_elements=MAX)
    columns = PayloadColumns([payload], layout, max_elements=MAX, budget=1000)

    assert torch.equal(_flat(decode(payload, max_elements=MAX)), expected)
    assert torch.equal(row, expected)
    assert torch.equal(columns.columns(0, numel(layout))[0], expected)
    assert torch.equal(columns.columns(50, 211)[0], expected[50:211])


def test_decode_and_decode_into_equal_each_tensor_decoded_alone() -> None:
    delta = _delta(1)
    payload = encode(delta, SPEC, own=OWN)
    layout = layout_of(delta)
    expected = _alone(delta, OWN)

    decoded = decode(payload, max_elements=MAX)
    row = torch.full((3, numel(layout)), 7.0)
    decode_into(payload, row[1], layout, max_elements=MAX)

    assert decoded.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(decoded[name], value), name
    assert torch.equal(row[1], _flat(expected))
    assert bool((row[0] == 7).all()) and bool((row[2] == 7).all())


def test_decode_accumulate_and_apply_equal_each_tensor_decoded_alone() -> None:
    # Prepare: a mixed envelope among envelopes of one codec, of the same layout
    deltas = [_delta(seed) for seed in (2, 3, 4)]
    layout = layout_of(deltas[0])
    payloads = [encode(deltas[0], SPEC, own=OWN), encode(deltas[1], SPEC), encode(deltas[2], SPEC)]
    weights = [0.5, 0.3, 0.2]
    params = {name: torch.linspace(-1, 1, t.numel()).view(t.shape) for name, t in deltas[0].items()}
    before = {name: t.clone() for name, t in params.items()}

    # Execute
    summed = torch.zeros(numel(layout))
    decode_accumulate(payloads, weights, summed, layout, max_elements=MAX)
    apply_update_(params, payloads[0], alpha=0.7, max_elements=MAX)

    # Assert
    alone = [
        _flat(_alone(deltas[0], OWN)),
        _flat(_alone(deltas[1], {})),
        _flat(_alone(deltas[2], {})),
    ]
    expected = torch.zeros(numel(layout))
    for w, x in zip(weights, alone, strict=True):
        expected.add_(x, alpha=w)
    assert torch.allclose(summed, expected, rtol=1e-6, atol=1e-7)
    mine = _alone(deltas[0], OWN)
    for name, value in params.items():
        assert torch.allclose(value, before[name] + 0.7 * mine[name], rtol=1e-6, atol=1e-7), name


def test_payload_columns_read_mixed_and_plain_envelopes_range_by_range() -> None:
    # Prepare: rows in three layouts of codecs (all BitDelta, mixed, another mixed)
    deltas = [_delta(seed) for seed in range(5)]
    layout = layout_of(deltas[0])
    other = {**OWN, "a.lora_B_carry": CodecSpec("int4", group_size=8)}
    payloads = [
        encode(deltas[0], SPEC),
        encode(deltas[1], SPEC, own=OWN),
        encode(deltas[2], SPEC, own=other),
        encode(deltas[3], SPEC, own=OWN),
        encode(deltas[4], SPEC),
    ]
    full = torch.empty(len(payloads), numel(layout))
    for i, payload in enumerate(payloads):
        decode_into(payload, full[i], layout, max_elements=MAX)

    # Execute / Assert: every range, all rows and a subset of rows
    source = PayloadColumns(payloads, layout, max_elements=MAX, budget=1000)
    d = numel(layout)
    for width in (1, 5, 8, 33, d):
        for start in range(0, d, width):
            stop = min(start + width, d)
            assert torch.equal(source.columns(start, stop), full[:, start:stop]), (start, stop)
            assert torch.equal(source.columns(start, stop, [3, 1]), full[[3, 1], start:stop])


def test_payload_columns_of_one_mixed_codec_layout_take_the_sign_path_for_bitdelta_tensors() -> (
    None
):
    deltas = [_delta(seed) for seed in range(3)]
    layout = layout_of(deltas[0])
    payloads = [encode(x, SPEC, own=OWN) for x in deltas]
    full = torch.empty(3, numel(layout))
    for i, payload in enumerate(payloads):
        decode_into(payload, full[i], layout, max_elements=MAX)

    source = PayloadColumns(payloads, layout, max_elements=MAX, budget=1000)

    assert source._signs is not None
    covered = {layout[t].name for t in source._signs.covered}
    assert covered == {"a.lora_B", "b.lora_B", "c.weight"}  # one group and scale dtype in all
    assert torch.equal(source.columns(0, numel(layout)), full)
    assert torch.equal(source.columns(90, 150), full[:, 90:150])


def test_envelope_norm_of_a_mixed_envelope_is_the_norm_of_its_values() -> None:
    delta = _delta(5)
    payload = encode(delta, SPEC, own=OWN)

    norm = envelope_norm(payload, inspect_envelope(payload, max_elements=MAX))

    expected = math.sqrt(sum(float(t.double().square().sum()) for t in _alone(delta, OWN).values()))
    assert norm == pytest.approx(expected, rel=1e-9)


def test_honest_norm_bound_takes_the_largest_growth_of_any_tensor() -> None:
    layout = layout_of(_delta(0))
    own = {"a.lora_B_carry": CodecSpec("int8", group_size=16)}
    cap = feedback_cap(1.0, 0.0, numel(layout))
    slack = math.sqrt(numel(layout)) * 2.0**-24

    plain = honest_norm_bound(SPEC, layout, clip_norm=1.0)
    mixed = honest_norm_bound(SPEC, layout, clip_norm=1.0, own=own)

    int8 = codec_growth(own["a.lora_B_carry"], [16])
    assert int8 == pytest.approx(1 + (1 + 2.0**-11) * 4 / 254)  # sqrt(16) / (2 * 127)
    assert plain == pytest.approx(1.01 * (1 + 2.0**-11) * cap + slack)
    assert mixed == pytest.approx(1.01 * int8 * cap + slack)


def test_an_unknown_tensor_in_own_is_refused() -> None:
    with pytest.raises(ValueError, match=r"x\.lora_B_carry: a codec is given for a tensor"):
        encode({"a": torch.ones(3)}, SPEC, own={"x.lora_B_carry": CodecSpec("int8")})


def _with_table(payload: bytes, edit: Callable[[bytes], bytes], version: int = 3) -> bytes:
    """`payload` with its inflated table edited, deflated again, the version set and the
    SHA-256 recomputed (so only the table is wrong)."""
    (length,) = struct.unpack_from("<I", payload, HEAD)
    table = zlib.compress(edit(zlib.decompress(payload[HEAD + 4 : HEAD + 4 + length])))
    head = payload[:4] + struct.pack("<H", version) + payload[6:HEAD]
    body = head + struct.pack("<I", len(table)) + table + payload[HEAD + 4 + length : -32]
    return body + hashlib.sha256(body).digest()


ENTRY_A = 2 + 1 + 2 + 8  # name length, "a", dtype and ndim, shape (4,)


def _set_own(
    codec: int, gran: int, group: int, scale: int, entry: int = 0
) -> Callable[[bytes], bytes]:
    """Replace the codec parameters of entry 0 ("a", shape (4,)) or 1 ("b", shape (3,))."""
    own = struct.pack("<BBIB", codec, gran, group, scale)
    at = ENTRY_A + entry * (ENTRY_A + 7)
    return lambda t: t[:at] + own + t[at + 7 :]


HOSTILE = [
    (_set_own(99, 0, 4, 0), "unknown codec id 99"),
    (_set_own(3, 7, 4, 0), "unknown granularity id 7"),
    (_set_own(3, 0, 4, 9), "scale dtype id 9"),
    (_set_own(3, 0, 0, 0), "group size 0"),
    (_set_own(3, 0, 2**32 - 1, 0), "invalid codec parameters"),
    (_set_own(3, 0, 1, 2), "truncated envelope"),  # one float32 scale per value: more bytes
    (_set_own(0, 0, 4, 0), "truncated envelope"),  # raw float32 values need 16 bytes
    (_set_own(3, 0, 4, 0, entry=1), "oversized envelope"),  # float16 scales: 2 bytes fewer
    (lambda t: t[:-7], "tensor table runs past the end"),  # the last codec is missing
    (lambda t: t[:-3], "tensor table runs past the end"),
    (lambda t: t + b"\0", "bytes after its last entry"),
    (lambda t: t[:3] + b"\x10" + t[4:], "unknown dtype id 16"),
]


@pytest.mark.parametrize(("edit", "message"), HOSTILE)
def test_hostile_version_3_tables_are_refused_in_one_line(
    edit: Callable[[bytes], bytes], message: str
) -> None:
    # Prepare: two BitDelta tensors of group 4, the second with its own float32 scales
    delta = {"a": torch.tensor([0.5, -1.5, 1.0, -2.0]), "b": torch.tensor([1.0, -0.5, 3.0])}
    payload = encode(
        delta,
        CodecSpec("bitdelta", group_size=4),
        own={"b": CodecSpec("bitdelta", 4, scale_dtype="float32")},
    )
    assert inspect_envelope(payload, max_elements=7).version == 3

    # Execute / Assert: every reader refuses it the same way
    hostile = _with_table(payload, edit)
    for read in (
        lambda: inspect_envelope(hostile, max_elements=7),
        lambda: decode(hostile, max_elements=7),
        lambda: decode_into(hostile, torch.empty(7), layout_of(delta), max_elements=7),
        lambda: PayloadColumns([hostile], layout_of(delta), max_elements=7, budget=64),
    ):
        with pytest.raises(EnvelopeError, match=message) as info:
            read()
        assert "\n" not in str(info.value)


def test_a_version_2_table_read_as_version_3_is_refused() -> None:
    payload = encode({"a": torch.ones(4), "b": torch.ones(3)}, CodecSpec("bitdelta", group_size=4))

    with pytest.raises(EnvelopeError) as info:
        inspect_envelope(_with_table(payload, lambda t: t), max_elements=7)
    assert "\n" not in str(info.value)


def test_a_huge_shape_in_a_version_3_entry_is_refused_before_allocating() -> None:
    payload = encode({"a": torch.ones(4)}, SPEC, own={"a": CodecSpec("none")})
    huge = struct.pack("<Q", 2**40)

    hostile = _with_table(payload, lambda t: t[:5] + huge + t[13:])

    with pytest.raises(EnvelopeError, match="max_elements"):
        decode(hostile, max_elements=10**6)
    with pytest.raises(EnvelopeError, match="truncated"):
        decode(hostile, max_elements=2**41)


def test_a_nan_scale_of_a_carried_tensor_is_refused_by_every_reader() -> None:
    # Prepare: the int8 tensor's fp16 scale set to NaN, hash recomputed
    delta = {"a": torch.ones(4), "b": torch.tensor([1.0, -0.5])}
    payload = encode(delta, CodecSpec("bitdelta", group_size=4), own={"b": CodecSpec("int8")})
    header = inspect_envelope(payload, max_elements=6)
    at = header.sections[1].scales_offset
    body = payload[:at] + bytes.fromhex("007e") + payload[at + 2 : -32]
    hostile = body + hashlib.sha256(body).digest()

    # Execute / Assert
    with pytest.raises(EnvelopeError, match="b: NaN"):
        decode(hostile, max_elements=6)
    with pytest.raises(EnvelopeError, match="b: NaN"):
        envelope_norm(hostile, inspect_envelope(hostile, max_elements=6))
    with pytest.raises(EnvelopeError, match="b: NaN"):
        PayloadColumns([hostile], layout_of(delta), max_elements=6, budget=64)
