"""Triton kernels against the torch reference, bit for bit.

Without CUDA they run in the Triton interpreter on CPU tensors (`conftest.py` sets
TRITON_INTERPRET=1); with CUDA the same tests run compiled on the GPU.
"""

import pytest
import torch

from zoo_gym.compression import (
    CodecSpec,
    apply_update_,
    bitdelta,
    decode,
    decode_accumulate,
    decode_into,
    encode,
    kernels,
)
from zoo_gym.core.delta import layout_of

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_kernels_can_run_here() -> None:
    assert kernels.available(), "triton is not installed"
    assert DEVICE == "cuda" or kernels.interpreted(), "TRITON_INTERPRET=1 was not set"


@pytest.mark.parametrize("n", [1, 8, 100, 1027])
@pytest.mark.parametrize("group", [8, 128, 136])
def test_pack_matches_reference(n: int, group: int) -> None:
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    x[::7] = 0.0

    bits, scales = kernels.pack(x.to(DEVICE), group)

    ref_bits, ref_scales = bitdelta.pack(x, group)
    assert torch.equal(bits.cpu(), ref_bits)
    assert torch.equal(scales.cpu(), ref_scales)  # the same additions in the same order


@pytest.mark.parametrize(
    "group",
    [1032, pytest.param(8192, marks=pytest.mark.slow)],  # 2 and 16 blocks of 64 vectors
)
def test_pack_of_long_groups_matches_reference(group: int) -> None:
    gen = torch.Generator().manual_seed(group)
    n = 3 * group + 5
    x = torch.randn(n, generator=gen) * torch.randn(n, generator=gen).exp()

    bits, scales = kernels.pack(x.to(DEVICE), group)

    ref_bits, ref_scales = bitdelta.pack(x, group)
    assert torch.equal(bits.cpu(), ref_bits)
    assert torch.equal(scales.cpu(), ref_scales)


@pytest.mark.parametrize("n", [1, 9, 1027])
@pytest.mark.parametrize("group", [1, 3, 128, 1027])
def test_unpack_accumulate_apply_match_reference(n: int, group: int) -> None:
    gen = torch.Generator().manual_seed(n + group)
    bits, scales = bitdelta.pack(torch.randn(n, generator=gen), group)
    base = torch.randn(n, generator=gen)

    out = torch.empty(n, device=DEVICE)
    kernels.unpack(bits.to(DEVICE), scales.to(DEVICE), group, out)
    ref = torch.empty(n)
    bitdelta.unpack(bits, scales, group, ref)
    assert torch.equal(out.cpu(), ref)

    acc = base.clone().to(DEVICE)
    kernels.accumulate(bits.to(DEVICE), scales.to(DEVICE), group, acc, 0.37)
    ref_acc = base.clone()
    bitdelta.accumulate(bits, scales, group, ref_acc, 0.37)
    assert torch.equal(acc.cpu(), ref_acc)

    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        weights = base.to(dtype).clone().to(DEVICE)
        kernels.apply_(weights, bits.to(DEVICE), scales.to(DEVICE), group, 0.5)
        ref_weights = base.to(dtype).clone()
        bitdelta.apply_(ref_weights, bits, scales, group, 0.5)
        assert torch.equal(weights.cpu(), ref_weights), dtype


def _clients(k: int) -> tuple[list[bytes], dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(k)
    deltas = [{"a": torch.randn(4, 40, generator=gen), "b": torch.randn(9, generator=gen)}]
    deltas += [{n: torch.randn_like(t) for n, t in deltas[0].items()} for _ in range(k - 1)]
    return [encode(d, CodecSpec("bitdelta", group_size=16)) for d in deltas], deltas[0]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_decode_accumulate_equals_sum_of_decodes(backend: str) -> None:
    payloads, example = _clients(3)
    layout = layout_of(example)
    weights = [0.5, 0.25, 0.25]
    out = torch.zeros(169, device=DEVICE)

    decode_accumulate(payloads, weights, out, layout, max_elements=169, backend=backend)

    expected = torch.zeros(169)
    for payload, w in zip(payloads, weights, strict=True):
        row = torch.empty(169)
        decode_into(payload, row, layout, max_elements=169)
        expected += w * row
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_apply_update_in_place(backend: str) -> None:
    payloads, example = _clients(1)
    params = {n: torch.ones_like(t, device=DEVICE).to(torch.bfloat16) for n, t in example.items()}

    apply_update_(params, payloads[0], alpha=1.0, max_elements=169, backend=backend)

    decoded = decode(payloads[0], max_elements=169)
    for name, value in params.items():
        assert torch.equal(value.cpu(), (1 + decoded[name]).to(torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_encode_and_decode_into_match_cpu() -> None:
    delta = {"w": torch.randn(512, 512)}
    layout = layout_of(delta)
    cpu = encode(delta, CodecSpec())
    out = torch.empty(512 * 512, device="cuda")

    decode_into(cpu, out, layout, max_elements=512 * 512)

    assert torch.equal(out.cpu(), decode(cpu, max_elements=512 * 512)["w"].view(-1))
    assert encode({"w": delta["w"].cuda()}, CodecSpec()) == cpu  # the same bytes
