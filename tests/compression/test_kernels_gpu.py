"""Triton kernels and the envelope's deployment functions on a GPU, at the sizes they serve.

A full-rank delta of one 4096 x 4096 matrix and a LoRA update of 192 B matrices (896, 16), as
a 0.5B model's rank-16 adapter sends; every result is compared with the CPU torch path, bit
for bit (payload bytes, scales, decoded values, sums, weights).
"""

from __future__ import annotations

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
from zoo_gym.core.delta import Delta, layout_of, numel

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _lora(seed: int) -> Delta:
    gen = torch.Generator().manual_seed(seed)
    return {f"layers.{i:03d}.lora_B": torch.randn(896, 16, generator=gen) for i in range(192)}


def test_the_kernels_are_active_on_cuda() -> None:
    assert kernels.active_for(torch.zeros(1, device="cuda"))


@pytest.mark.parametrize("group", [8, 128, 136, 4096, 8192])
def test_pack_of_a_4096_square_matrix_matches_the_cpu(group: int) -> None:
    x = torch.randn(4096 * 4096, generator=torch.Generator().manual_seed(group))
    x = x * x.roll(1).exp()  # heavy tails: the sum order shows in the last bit

    bits, scales = kernels.pack(x.cuda(), group)

    ref_bits, ref_scales = bitdelta.pack(x, group)
    assert torch.equal(bits.cpu(), ref_bits)
    assert torch.equal(scales.cpu(), ref_scales)


def test_unpack_accumulate_apply_of_a_4096_square_matrix_match_the_cpu() -> None:
    gen = torch.Generator().manual_seed(0)
    n, group = 4096 * 4096 + 5, 128
    bits, scales = bitdelta.pack(torch.randn(n, generator=gen), group)
    base = torch.randn(n, generator=gen)
    dev_bits, dev_scales = bits.cuda(), scales.cuda()

    out = torch.empty(n, device="cuda")
    kernels.unpack(dev_bits, dev_scales, group, out)
    ref = torch.empty(n)
    bitdelta.unpack(bits, scales, group, ref)
    assert torch.equal(out.cpu(), ref)

    acc = base.cuda()
    kernels.accumulate(dev_bits, dev_scales, group, acc, 0.37)
    ref_acc = base.clone()
    bitdelta.accumulate(bits, scales, group, ref_acc, 0.37)
    assert torch.equal(acc.cpu(), ref_acc)

    weights = base.to(torch.bfloat16).cuda()
    kernels.apply_(weights, dev_bits, dev_scales, group, 0.5)
    ref_weights = base.to(torch.bfloat16)
    bitdelta.apply_(ref_weights, bits, scales, group, 0.5)
    assert torch.equal(weights.cpu(), ref_weights)


@pytest.mark.parametrize(
    "spec", [CodecSpec(), CodecSpec(scale_dtype="float32"), CodecSpec(granularity="row")]
)
def test_lora_update_encodes_and_decodes_on_cuda_as_on_the_cpu(spec: CodecSpec) -> None:
    delta = _lora(1)
    d = numel(layout_of(delta))

    payload = encode({name: t.cuda() for name, t in delta.items()}, spec)
    decoded = decode(payload, max_elements=d, device="cuda")

    cpu_payload = encode(delta, spec)
    assert payload == cpu_payload
    for name, value in decode(cpu_payload, max_elements=d).items():
        assert decoded[name].device.type == "cuda"
        assert torch.equal(decoded[name].cpu(), value), name


def test_full_delta_encodes_on_cuda_as_on_the_cpu() -> None:
    delta = {"w": torch.randn(4096, 4096, generator=torch.Generator().manual_seed(2))}
    assert encode({"w": delta["w"].cuda()}, CodecSpec()) == encode(delta, CodecSpec())


def test_coordinator_functions_on_cuda_match_the_cpu() -> None:
    payloads = [encode(_lora(seed), CodecSpec()) for seed in range(4)]
    layout = layout_of(_lora(0))
    d = numel(layout)
    weights = [0.4, 0.3, 0.2, 0.1]

    row = torch.empty(d, device="cuda")
    decode_into(payloads[0], row, layout, max_elements=d)
    summed = torch.zeros(d, device="cuda")
    decode_accumulate(payloads, weights, summed, layout, max_elements=d)
    params = {ts.name: torch.ones(ts.shape, dtype=torch.bfloat16, device="cuda") for ts in layout}
    apply_update_(params, payloads[1], alpha=0.5, max_elements=d)

    ref_row = torch.empty(d)
    decode_into(payloads[0], ref_row, layout, max_elements=d)
    ref_sum = torch.zeros(d)
    decode_accumulate(payloads, weights, ref_sum, layout, max_elements=d)
    ref_params = {ts.name: torch.ones(ts.shape, dtype=torch.bfloat16) for ts in layout}
    apply_update_(ref_params, payloads[1], alpha=0.5, max_elements=d)
    assert torch.equal(row.cpu(), ref_row)
    assert torch.equal(summed.cpu(), ref_sum)
    for name, value in params.items():
        assert torch.equal(value.cpu(), ref_params[name]), name


def test_a_carry_round_s_mixed_envelope_on_cuda_matches_the_cpu() -> None:
    # Prepare: 192 B matrices and their carried Bs in int8 (float32 scales), as a round that
    # changes A sends them; the Bs go through the kernels, the carried Bs through torch
    carried = {name + "_carry": t * 0.1 for name, t in _lora(5).items()}
    deltas = [{**_lora(seed), **carried} for seed in (3, 4)]
    layout = layout_of(deltas[0])
    d = numel(layout)
    own = dict.fromkeys(carried, CodecSpec("int8", scale_dtype="float32"))

    # Execute
    payload = encode({name: t.cuda() for name, t in deltas[0].items()}, CodecSpec(), own=own)
    decoded = decode(payload, max_elements=d, device="cuda")
    other = encode(deltas[1], CodecSpec(), own=own)
    row = torch.empty(d, device="cuda")
    decode_into(payload, row, layout, max_elements=d)
    summed = torch.zeros(d, device="cuda")
    decode_accumulate([payload, other], [0.6, 0.4], summed, layout, max_elements=d)

    # Assert: the CPU's bytes and values (sums up to the rounding of one multiply-add)
    assert payload == encode(deltas[0], CodecSpec(), own=own)
    for name, value in decode(payload, max_elements=d).items():
        assert torch.equal(decoded[name].cpu(), value), name
    ref_row = torch.empty(d)
    decode_into(payload, ref_row, layout, max_elements=d)
    ref_sum = torch.zeros(d)
    decode_accumulate([payload, other], [0.6, 0.4], ref_sum, layout, max_elements=d)
    assert torch.equal(row.cpu(), ref_row)
    torch.testing.assert_close(summed.cpu(), ref_sum, rtol=1e-6, atol=1e-7)
