"""The envelope's deployment functions through the Triton kernels, against the CPU torch path.

``ZOO_TRITON_ON_CPU=1`` (with TRITON_INTERPRET=1, set by `conftest.py` without CUDA) makes
`kernels.active_for` send CPU tensors through the kernels, so `encode`, `decode`,
`decode_into`, `decode_accumulate` and `apply_update_` take the path they take on a GPU.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import pytest
import torch

from zoo_gym.compression import (
    CodecSpec,
    apply_update_,
    decode,
    decode_accumulate,
    decode_into,
    encode,
    kernels,
)
from zoo_gym.compression.kernels import bitdelta_triton
from zoo_gym.core.delta import Delta, layout_of, numel

SPECS = [
    CodecSpec("bitdelta", group_size=128),  # the default
    CodecSpec("bitdelta", group_size=8, scale_dtype="float32"),
    CodecSpec("bitdelta", group_size=136, scale_dtype="bfloat16"),
    CodecSpec("bitdelta", granularity="row", scale_dtype="float32"),
]


def _delta(seed: int) -> Delta:
    """Several tensors of odd lengths, some smaller than a group, heavy-tailed values."""
    gen = torch.Generator().manual_seed(seed)
    shapes = {"a.weight": (13, 37), "b.bias": (5,), "c.lora_B": (40, 16), "d": (3, 3, 29)}
    delta = {}
    for name, shape in shapes.items():
        x = torch.randn(shape, generator=gen) * torch.randn(shape, generator=gen).exp()
        delta[name] = x.flatten().index_fill_(0, torch.arange(0, x.numel(), 11), 0.0).view(shape)
    return delta


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter[str]]:
    """Counts kernel launches; kernels off until a test calls `_kernels_on`."""
    monkeypatch.delenv(kernels.ON_CPU, raising=False)
    counts: Counter[str] = Counter()
    for name in ("pack", "unpack", "apply_"):
        original = getattr(bitdelta_triton, name)

        def counted(*args: object, _f: object = original, _n: str = name) -> None:
            counts[_n] += 1
            _f(*args)  # type: ignore[operator]

        monkeypatch.setattr(bitdelta_triton, name, counted)
    yield counts


def _kernels_on(monkeypatch: pytest.MonkeyPatch, on: bool) -> None:
    if on:
        monkeypatch.setenv(kernels.ON_CPU, "1")
    else:
        monkeypatch.delenv(kernels.ON_CPU, raising=False)


def test_the_switch_needs_both_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(kernels.ON_CPU, raising=False)
    assert not kernels.active_for(torch.zeros(1))
    monkeypatch.setenv(kernels.ON_CPU, "1")
    assert kernels.active_for(torch.zeros(1)) == kernels.interpreted()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not kernels.active_for("cpu")
    assert kernels.active_for("cuda")  # Triton is installed here


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.granularity}{s.group_size}")
def test_encode_and_decode_match_the_cpu_path(
    spec: CodecSpec, calls: Counter[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare
    delta = _delta(spec.group_size)
    d = numel(layout_of(delta))
    cpu_payload = encode(delta, spec)
    cpu_decoded = decode(cpu_payload, max_elements=d)

    # Execute
    _kernels_on(monkeypatch, True)
    payload = encode(delta, spec)
    decoded = decode(payload, max_elements=d)

    # Assert: the same bytes, the same values, and the kernels did the work
    assert payload == cpu_payload
    assert decoded.keys() == cpu_decoded.keys()
    for name, value in decoded.items():
        assert torch.equal(value, cpu_decoded[name]), name
    assert calls["pack"] >= 1 and calls["unpack"] == len(delta)


def test_decode_into_accumulate_and_apply_match_the_cpu_path(
    calls: Counter[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: three contributors' updates, one of them with row scales
    deltas = [_delta(seed) for seed in (1, 2, 3)]
    layout = layout_of(deltas[0])
    d = numel(layout)
    specs = [SPECS[0], SPECS[0], SPECS[3]]
    payloads = [encode(x, spec) for x, spec in zip(deltas, specs, strict=True)]
    weights = [0.5, 0.3, 0.2]
    base = {name: torch.linspace(-1, 1, t.numel()).view(t.shape) for name, t in deltas[0].items()}

    def run() -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        row = torch.empty(d)
        decode_into(payloads[0], row, layout, max_elements=d)
        summed = torch.zeros(d)
        decode_accumulate(payloads, weights, summed, layout, max_elements=d)
        params = {name: t.to(torch.bfloat16) for name, t in base.items()}
        apply_update_(params, payloads[1], alpha=0.7, max_elements=d)
        return row, summed, params

    expected = run()

    # Execute
    _kernels_on(monkeypatch, True)
    got = run()

    # Assert
    assert torch.equal(got[0], expected[0])
    assert torch.equal(got[1], expected[1])
    for name, value in got[2].items():
        assert torch.equal(value, expected[2][name]), name
    assert calls["unpack"] == 4 + 3 * 4 and calls["apply_"] == 4


def test_a_mixed_envelope_sends_its_bitdelta_tensors_through_the_kernels(
    calls: Counter[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: BitDelta tensors (group 128 and row scales) beside int8 and float32 ones
    deltas = [_delta(seed) for seed in (4, 5)]
    layout = layout_of(deltas[0])
    d = numel(layout)
    own = {
        "b.bias": CodecSpec("int8", group_size=16),
        "c.lora_B": CodecSpec("none"),
        "d": CodecSpec("bitdelta", granularity="row", scale_dtype="float32"),
    }
    base = {name: torch.linspace(-1, 1, t.numel()).view(t.shape) for name, t in deltas[0].items()}

    def run() -> tuple[
        list[bytes], dict[str, torch.Tensor], torch.Tensor, torch.Tensor, dict[str, torch.Tensor]
    ]:
        payloads = [encode(x, SPECS[0], own=own) for x in deltas]
        decoded = decode(payloads[0], max_elements=d)
        row = torch.empty(d)
        decode_into(payloads[1], row, layout, max_elements=d)
        summed = torch.zeros(d)
        decode_accumulate(payloads, [0.6, 0.4], summed, layout, max_elements=d)
        params = {name: t.to(torch.bfloat16) for name, t in base.items()}
        apply_update_(params, payloads[0], alpha=0.7, max_elements=d)
        return payloads, decoded, row, summed, params

    expected = run()

    # Execute
    _kernels_on(monkeypatch, True)
    got = run()

    # Assert: the same bytes and values; the two BitDelta tensors of each envelope went
    # through the kernels on every path (decode, decode_into, 2 x accumulate, apply)
    assert got[0] == expected[0]
    for name, value in got[1].items():
        assert torch.equal(value, expected[1][name]), name
    assert torch.equal(got[2], expected[2]) and torch.equal(got[3], expected[3])
    for name, value in got[4].items():
        assert torch.equal(value, expected[4][name]), name
    assert calls["pack"] >= 2
    assert calls["unpack"] == 2 * 4 and calls["apply_"] == 2
