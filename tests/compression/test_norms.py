"""Norms of envelopes without a dense decode, and how much each codec can grow a norm."""

from __future__ import annotations

import hashlib
import math
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zoo_gym.compression import (
    CODECS,
    CodecSpec,
    EnvelopeError,
    NonFiniteUpdate,
    decode,
    encode,
    envelope_norm,
    inspect_envelope,
)
from zoo_gym.compression.norms import codec_growth, noise_norm_bound
from zoo_gym.compression.spec import GRANULARITIES, group_length

MAX = 1 << 20


def norm_of(delta: dict[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float(t.double().square().sum()) for t in delta.values()))


def rehashed(body: bytes) -> bytes:
    return body + hashlib.sha256(body).digest()


@st.composite
def deltas(draw: st.DrawFn) -> dict[str, torch.Tensor]:
    """One to three tensors of up to 300 values: dense, sparse (one value per stretch) or constant."""
    delta = {}
    for i in range(draw(st.integers(1, 3))):
        shape = (draw(st.integers(1, 20)), draw(st.integers(1, 15)))
        torch.manual_seed(draw(st.integers(0, 2**31)))
        kind = draw(st.sampled_from(["dense", "sparse", "constant"]))
        x = torch.randn(shape) * draw(st.sampled_from([1e-3, 1.0, 50.0]))
        if kind == "sparse":
            x = x * (torch.rand(shape) < 0.05)
        elif kind == "constant":
            x = torch.full(shape, float(x.flatten()[0]))
        delta[f"t{i}"] = x
    return delta


specs = st.builds(
    CodecSpec,
    codec=st.sampled_from(CODECS),
    group_size=st.sampled_from([8, 16, 128]),
    granularity=st.sampled_from(GRANULARITIES),
    scale_dtype=st.sampled_from(["float16", "float32"]),
)


@settings(max_examples=150, deadline=None)
@given(delta=deltas(), spec=specs)
def test_envelope_norm_is_the_norm_of_the_decoded_update(
    delta: dict[str, torch.Tensor], spec: CodecSpec
) -> None:
    payload = encode(delta, spec)

    norm = envelope_norm(payload, inspect_envelope(payload, max_elements=MAX))

    assert norm == pytest.approx(norm_of(decode(payload, max_elements=MAX)), rel=1e-9, abs=1e-12)


@settings(max_examples=200, deadline=None)
@given(delta=deltas(), spec=specs)
def test_no_codec_grows_a_norm_beyond_its_stated_factor(
    delta: dict[str, torch.Tensor], spec: CodecSpec
) -> None:
    groups = [group_length(spec, tuple(t.shape)) for t in delta.values()]
    d = sum(t.numel() for t in delta.values())

    sent = norm_of(decode(encode(delta, spec), max_elements=MAX))

    # float16 scales below the normal range round up by at most 2^-25 each
    assert sent <= codec_growth(spec, groups) * norm_of(delta) * (1 + 1e-6) + math.sqrt(d) * 2**-24


def test_bitdelta_never_grows_a_norm_and_int2_grows_sparse_groups_most() -> None:
    one_hot = torch.zeros(128)
    one_hot[0] = 1.0

    bitdelta = norm_of(decode(encode({"x": one_hot}, CodecSpec("bitdelta", 128)), max_elements=MAX))
    int2 = norm_of(decode(encode({"x": one_hot}, CodecSpec("int2", 128)), max_elements=MAX))

    assert bitdelta == pytest.approx(1 / math.sqrt(128), rel=1e-3)  # ||x||_1 / sqrt(k)
    assert 1 + math.sqrt(127) / 3 - 0.01 < int2**2 <= codec_growth(CodecSpec("int2"), [128]) ** 2


def test_an_envelope_of_empty_tensors_has_norm_zero() -> None:
    payload = encode({"a": torch.ones(0, 4), "b": torch.ones(0)}, CodecSpec("bitdelta", 8))

    assert envelope_norm(payload, inspect_envelope(payload, max_elements=MAX)) == 0.0


@pytest.mark.parametrize(("bits", "what"), [(0x7E00, "NaN"), (0x7C00, "Inf"), (0xFC00, "-Inf")])
def test_a_non_finite_bitdelta_scale_is_named(bits: int, what: str) -> None:
    payload = encode({"a": torch.ones(16), "b": torch.ones(16)}, CodecSpec("bitdelta", 8))
    section = inspect_envelope(payload, max_elements=MAX).sections[1]
    at = section.scales_offset + 2  # the second scale of tensor b
    bad = rehashed(payload[:at] + struct.pack("<H", bits) + payload[at + 2 : -32])

    with pytest.raises(NonFiniteUpdate, match=r"^b: NaN or Inf scale"):
        envelope_norm(bad, inspect_envelope(bad, max_elements=MAX))


@pytest.mark.parametrize(("codec", "fmt"), [("none", "<f"), ("fp16", "<e"), ("bf16", None)])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_non_finite_raw_value_is_named(codec: str, fmt: str | None, value: float) -> None:
    payload = encode({"w": torch.ones(4, 4)}, CodecSpec(codec))
    section = inspect_envelope(payload, max_elements=MAX).sections[0]
    raw = (
        struct.pack(fmt, value)
        if fmt
        else torch.tensor([value], dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes()
    )
    at = section.data_offset + 3 * len(raw)
    bad = rehashed(payload[:at] + raw + payload[at + len(raw) : -32])

    with pytest.raises(NonFiniteUpdate, match=r"^w: NaN or Inf value"):
        envelope_norm(bad, inspect_envelope(bad, max_elements=MAX))


@pytest.mark.parametrize("codec", ["int8", "bitdelta"])
def test_a_negative_scale_is_invalid_but_not_called_non_finite(codec: str) -> None:
    payload = encode({"a": torch.ones(16)}, CodecSpec(codec, 8))
    at = inspect_envelope(payload, max_elements=MAX).sections[0].scales_offset
    bad = rehashed(payload[:at] + struct.pack("<e", -1.0) + payload[at + 2 : -32])

    with pytest.raises(EnvelopeError, match="negative scale") as err:
        envelope_norm(bad, inspect_envelope(bad, max_elements=MAX))
    assert not isinstance(err.value, NonFiniteUpdate)


def test_the_noise_bound_holds_for_draws_and_is_close_to_the_mean_norm() -> None:
    generator = torch.Generator().manual_seed(0)
    d, std = 4096, 0.3
    norms = torch.linalg.vector_norm(torch.randn(2000, d, generator=generator) * std, dim=1)

    bound = noise_norm_bound(std, d)

    assert float(norms.max()) < bound < 1.2 * std * math.sqrt(d)
    assert noise_norm_bound(0.0, d) == 0.0
