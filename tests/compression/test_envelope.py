import hashlib
import struct
import zlib

import pytest
import torch

from zoo_gym.compression import (
    CODECS,
    CodecSpec,
    EnvelopeError,
    bitdelta,
    decode,
    decode_into,
    encode,
    inspect_envelope,
)
from zoo_gym.core.delta import layout_of, numel

HAND = {"w": torch.tensor([0.5, -1.5, 1.0, -2.0])}
HAND_HEX = (
    "5a474445"
    "0100"
    "03"
    "00"
    "04000000"
    "00"
    "000000"
    "01000000"  # header
    "0100"
    "77"
    "00"
    "01"
    "0400000000000000"  # tensor "w", float32, shape (4,)
    "003d"
    "a0"  # fp16 scale 1.25, signs + - + - = 0b10100000
    "16cb631b9d8b5438f86b8601187c99fb23ac59a5adc6fb938b269efef76782d3"  # SHA-256
)
SMALL = {
    "a.bias": torch.tensor([0.25, -0.5, 0.0]),
    "a.weight": torch.tensor([[1.0, -2.0, 3.0, -4.0], [0.5, 0.5, -0.5, 0.0]]),
}
GOLDEN_SHA256 = {
    "bitdelta": "e9f2279a961b21da7af8fc2ed97569f572d4a9ee7b986943f88be10006ec549a",
    "int8": "8ffeb31dbc1e584b7a766f43abf19efe3f1dcf24482567803a0a6d45944ce2a9",
    "int4": "9b79e3d900dd17b5b185c5c78237a185ced125c63cd41f800ce69f51aaa6e13f",
    "int2": "569fe97ef7c1d990a69fcb1ed1463592f46c49b81695fd3e9c611881cdd24384",
    "ternary": "dddb4ebd1ef40df9d2b198d882c6a73c80d750f1f38389c6866bffed4e31a492",
    "fp16": "82685803463ae4a60b6a48d726ee49881a745ecc6fda73c94d75ae7fa4c70a62",
    "bf16": "64aa210043d97381f07345a8a4b09f2a83b61bb0a747108bc9bea11463232fe6",
    "none": "2bb57830e9f44d63bf3a7b5ab6de77ac24ff82608a7e2e7828d711157bda874f",
}


HEAD = 20  # magic to tensor count


def as_version_1(payload: bytes) -> bytes:
    """The version 1 envelope with the same content as version 2 `payload`: the table
    inflated in place, the version field 1, the SHA-256 recomputed."""
    assert payload[4:6] == b"\x02\x00"
    (length,) = struct.unpack_from("<I", payload, HEAD)
    table = zlib.decompress(payload[HEAD + 4 : HEAD + 4 + length])
    body = payload[:4] + b"\x01\x00" + payload[6:HEAD] + table + payload[HEAD + 4 + length : -32]
    return body + hashlib.sha256(body).digest()


def test_hand_computed_bitdelta_bytes_and_values() -> None:
    payload = encode(HAND, CodecSpec("bitdelta", group_size=4))

    # version 2: version 1's bytes with the table deflated (the stream itself is zlib's)
    assert payload[:HEAD].hex() == HAND_HEX[:8] + "0200" + HAND_HEX[12:40]
    (length,) = struct.unpack_from("<I", payload, HEAD)
    assert zlib.decompress(payload[HEAD + 4 : HEAD + 4 + length]).hex() == HAND_HEX[40:66]
    assert payload[HEAD + 4 + length :].hex()[:6] == "003da0"
    assert payload[-32:] == hashlib.sha256(payload[:-32]).digest()
    assert as_version_1(payload).hex() == HAND_HEX
    assert decode(payload, max_elements=4)["w"].tolist() == [1.25, -1.25, 1.25, -1.25]


def test_version_1_envelopes_still_decode() -> None:
    payload = bytes.fromhex(HAND_HEX)

    header = inspect_envelope(payload, max_elements=4)

    assert header.version == 1 and header.header_nbytes == HEAD + 13
    assert decode(payload, max_elements=4)["w"].tolist() == [1.25, -1.25, 1.25, -1.25]


@pytest.mark.parametrize("codec", CODECS)
def test_bytes_pinned(codec: str) -> None:
    payload = encode(SMALL, CodecSpec(codec, group_size=4))

    assert hashlib.sha256(as_version_1(payload)).hexdigest() == GOLDEN_SHA256[codec]
    old, new = decode(as_version_1(payload), max_elements=11), decode(payload, max_elements=11)
    assert old.keys() == new.keys() and all(torch.equal(old[k], new[k]) for k in old)


def test_a_tensor_table_of_repeated_prefixes_deflates() -> None:
    # Prepare: the B matrices of a 24-layer model with 7 target modules
    modules = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    delta = {
        f"model.layers.{i}.{'mlp' if m.endswith(('gate_proj', 'up_proj', 'down_proj')) else 'self_attn'}.{m}.lora_B": torch.ones(
            8, 8
        )
        for i in range(24)
        for m in modules
    }

    # Execute
    payload = encode(delta, CodecSpec("bitdelta", group_size=64))
    header = inspect_envelope(payload, max_elements=10**6)

    # Assert: the inline table would be 168 x (2 + name + 2 + 16) bytes; deflated, a fraction
    inline = sum(2 + len(name) + 2 + 16 for name in delta)
    assert header.header_nbytes - HEAD - 4 < inline / 4
    assert len(as_version_1(payload)) - len(payload) == inline - (header.header_nbytes - HEAD)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda t: t[:-2], "does not inflate"),
        (lambda t: zlib.compress(zlib.decompress(t) + b"x"), "bytes after its last entry"),
        (lambda t: zlib.compress(zlib.decompress(t)) + b"\0", "one zlib stream"),
    ],
)
def test_a_broken_deflated_table_is_refused_in_one_line(damage: object, message: str) -> None:
    # Prepare: rebuild a valid envelope around a damaged table (fresh SHA-256)
    payload = encode(SMALL, CodecSpec("bitdelta", group_size=4))
    (length,) = struct.unpack_from("<I", payload, HEAD)
    table = damage(payload[HEAD + 4 : HEAD + 4 + length])  # type: ignore[operator]
    body = payload[:HEAD] + struct.pack("<I", len(table)) + table + payload[HEAD + 4 + length : -32]

    # Execute / Assert
    with pytest.raises(EnvelopeError, match=message):
        inspect_envelope(body + hashlib.sha256(body).digest(), max_elements=11)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("granularity", ["group", "row", "matrix"])
def test_round_trip_every_codec(codec: str, granularity: str) -> None:
    gen = torch.Generator().manual_seed(0)
    delta = {
        "layer.0.w": torch.randn(7, 13, generator=gen),
        "layer.0.b": torch.randn(13, generator=gen).to(torch.bfloat16),
        "scalar": torch.tensor(0.3),
        "empty": torch.zeros(0, 3),
    }
    spec = CodecSpec(codec, group_size=8, granularity=granularity)

    decoded = decode(encode(delta, spec), max_elements=200)

    assert list(decoded) == sorted(delta)
    for name, tensor in delta.items():
        assert decoded[name].dtype == torch.float32
        assert decoded[name].shape == tensor.shape
        tol = {"none": 0, "fp16": 1e-3, "bf16": 1e-2, "int8": 0.02}.get(codec, 3.0)
        assert torch.allclose(decoded[name], tensor.float(), atol=tol, rtol=0)


def test_decode_into_writes_a_row_of_a_buffer() -> None:
    delta = {"b": torch.randn(5), "a": torch.randn(3, 4)}
    layout = layout_of(delta)
    payload = encode(delta, CodecSpec("bitdelta", group_size=8))
    buffer = torch.full((3, numel(layout)), 7.0)

    decode_into(payload, buffer[1], layout, max_elements=100)

    decoded = decode(payload, max_elements=100)
    assert torch.equal(buffer[1], torch.cat([decoded["a"].view(-1), decoded["b"]]))
    assert bool((buffer[0] == 7).all()) and bool((buffer[2] == 7).all())


def test_decode_into_rejects_other_layout() -> None:
    payload = encode({"a": torch.randn(4)}, CodecSpec())
    other = layout_of({"a": torch.randn(5)})

    with pytest.raises(EnvelopeError, match="differ from the layout"):
        decode_into(payload, torch.empty(5), other, max_elements=100)


def test_inspect_reports_header() -> None:
    payload = encode(SMALL, CodecSpec("bitdelta", group_size=4))

    header = inspect_envelope(payload, max_elements=11)

    assert header.codec == "bitdelta" and header.spec.group_size == 4
    assert header.layout == layout_of(SMALL)
    assert header.total_elements == 11
    assert header.total_nbytes == len(payload)


def test_inspect_checks_the_whole_payloads_sha256_when_given_one() -> None:
    """An envelope that is sound in itself but not the one a record names is refused."""
    payload = encode(SMALL, CodecSpec("bitdelta", group_size=4))
    other = encode({k: -v for k, v in SMALL.items()}, CodecSpec("bitdelta", group_size=4))

    whole = hashlib.sha256(payload).hexdigest()
    assert inspect_envelope(payload, max_elements=11, sha256=whole).total_nbytes == len(payload)
    inspect_envelope(other, max_elements=11)  # valid on its own
    with pytest.raises(EnvelopeError, match="not the one expected: it is corrupted or was"):
        inspect_envelope(other, max_elements=11, sha256=whole)
    damaged = payload[:-1] + bytes([payload[-1] ^ 1])  # its own digest, so the whole's too
    with pytest.raises(EnvelopeError, match="not the one expected"):
        inspect_envelope(damaged, max_elements=11, sha256=whole)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda p: p[:10], "truncated"),
        (lambda p: b"XXXX" + p[4:], "bad magic"),
        (lambda p: p[:4] + b"\x04\x00" + p[6:], "version"),
        (lambda p: p[:6] + b"\x63" + p[7:], "unknown codec"),
        (lambda p: p[:-1] + bytes([p[-1] ^ 1]), "SHA-256"),
        (lambda p: p[:-33] + p[-32:], "SHA-256"),
    ],
)
def test_invalid_envelopes_raise_one_line(mutate, message: str) -> None:  # type: ignore[no-untyped-def]
    payload = encode(SMALL, CodecSpec())

    with pytest.raises(EnvelopeError, match=message) as info:
        decode(mutate(payload), max_elements=100)
    assert "\n" not in str(info.value)


def _rehash(body: bytes) -> bytes:
    return body + hashlib.sha256(body).digest()


def test_over_max_elements_rejected_before_decoding() -> None:
    payload = encode({"w": torch.randn(64)}, CodecSpec())

    with pytest.raises(EnvelopeError, match="max_elements"):
        inspect_envelope(payload, max_elements=63)


def test_huge_declared_shape_with_valid_hash_is_rejected() -> None:
    body = bytearray(as_version_1(encode(HAND, CodecSpec("bitdelta", group_size=4)))[:-32])
    body[25:33] = (2**40).to_bytes(8, "little")  # shape of "w"

    with pytest.raises(EnvelopeError, match="max_elements"):
        decode(_rehash(bytes(body)), max_elements=10**6)
    with pytest.raises(EnvelopeError, match="truncated"):
        decode(_rehash(bytes(body)), max_elements=2**41)


def test_nan_scale_with_valid_hash_is_rejected() -> None:
    body = bytearray(as_version_1(encode(HAND, CodecSpec("bitdelta", group_size=4)))[:-32])
    body[33:35] = bytes.fromhex("007e")  # fp16 NaN

    with pytest.raises(EnvelopeError, match="NaN"):
        decode(_rehash(bytes(body)), max_elements=10)


def test_nonzero_padding_is_rejected() -> None:
    body = bytearray(as_version_1(encode(HAND, CodecSpec("bitdelta", group_size=4)))[:-32])
    body[35] |= 0x01

    with pytest.raises(EnvelopeError, match="padding"):
        decode(_rehash(bytes(body)), max_elements=10)


def test_encode_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="NaN"):
        encode({"w": torch.tensor([1.0, float("nan")])}, CodecSpec())
    with pytest.raises(ValueError, match="overflows"):
        encode({"w": torch.full((4,), 1e6)}, CodecSpec("bitdelta"))
    with pytest.raises(ValueError, match="float"):
        encode({"w": torch.tensor([1, 2])}, CodecSpec())


def test_encode_rejects_a_scale_that_overflows_among_others() -> None:
    delta = {"a": torch.randn(1000), "b": torch.full((300,), 1e6), "c": torch.randn(7)}

    with pytest.raises(ValueError, match="overflows float16"):
        encode(delta, CodecSpec("bitdelta"))


def test_encode_rejects_finite_values_whose_group_sum_overflows_float32() -> None:
    delta = {"w": torch.full((256,), 3e38)}

    with pytest.raises(ValueError, match="overflows float32"):
        encode(delta, CodecSpec("bitdelta", scale_dtype="float32"))


def test_encode_reads_strided_half_and_grad_tensors_as_their_float32_values() -> None:
    # Prepare: a transposed slice, a half tensor, a leaf that requires grad, an empty tensor
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(70, 40, generator=gen)
    half = torch.randn(33, 5, generator=gen).half()
    leaf = torch.randn(300, generator=gen, requires_grad=True)
    delta = {"a": base.t()[::2], "b": half, "c": leaf, "d": torch.zeros(0, 4)}
    plain = {"a": base.t()[::2].contiguous(), "b": half, "c": leaf.detach(), "d": torch.zeros(0, 4)}
    spec = CodecSpec("bitdelta", group_size=64)

    # Execute
    payload = encode(delta, spec)

    # Assert: strides and autograd change nothing; the half values are packed as float32
    assert payload == encode(plain, spec)
    bits, scales = bitdelta.pack(half.float().reshape(-1), 64)
    expected = torch.empty(half.numel())
    bitdelta.unpack(bits, scales.half().float(), 64, expected)
    assert torch.equal(decode(payload, max_elements=10_000)["b"].reshape(-1), expected)


@pytest.mark.parametrize(
    "kwargs", [{"codec": "int3"}, {"group_size": 0}, {"granularity": "col"}, {"scale_dtype": "x"}]
)
def test_spec_validation(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=r"group_size|unknown"):
        CodecSpec(**kwargs)  # type: ignore[arg-type]


def test_bitdelta_group_128_is_about_14x_smaller_than_bf16() -> None:
    delta = {"w": torch.randn(256, 256)}

    payload = encode(delta, CodecSpec("bitdelta", group_size=128))

    assert 2 * 256 * 256 / len(payload) >= 14.0
