"""The Triton binary GEMM against the torch reference.

Without CUDA the kernel runs in the Triton interpreter on CPU tensors (`conftest.py` sets
TRITON_INTERPRET=1 before Triton is imported); with CUDA the same tests run compiled on the GPU.
"""

import pytest
import torch

from zoo_gym.compression import bitdelta, kernels
from zoo_gym.serving import binary
from zoo_gym.serving.packed import PackedTensor

pytest.importorskip("triton")
from zoo_gym.serving import kernels as serving_kernels

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_the_kernel_can_run_here() -> None:
    assert DEVICE == "cuda" or kernels.interpreted(), "TRITON_INTERPRET=1 was not set"


@pytest.mark.parametrize(
    ("rows", "out", "inn", "group"),
    [
        ((3, 0, 17), 40, 64, 128),  # a group spans two rows; a variant without rows
        ((5, 2), 33, 40, 16),  # groups start mid-row; edges of every block
        ((1,), 64, 96, 8),
        ((2, 1, 3), 70, 256, 128),  # whole groups per row: the +-1 tiles, scaled per block
        ((1, 16, 17), 64, 384, 128),  # a variant with more rows than one block
        ((1, 2), 1100, 128, 128),  # more outputs than `GEMV_FEW`: the GEMV's wide programs
    ],
)
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("gemv_rows", [0, 32])  # the tiled dot alone; the GEMV where it can
def test_binary_gemm_matches_the_reference(
    rows: tuple[int, ...],
    out: int,
    inn: int,
    group: int,
    scale_dtype: torch.dtype,
    gemv_rows: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(serving_kernels, "GEMV_ROWS", gemv_rows)
    gen = torch.Generator().manual_seed(out + inn)
    weights = []
    for _ in rows:
        bits, scales = bitdelta.pack(torch.randn(out * inn, generator=gen), group)
        weights.append(PackedTensor((out, inn), bits, scales.to(scale_dtype), group))
    starts = [0]
    for n in rows:
        starts.append(starts[-1] + n)
    x = torch.randn(starts[-1], inn, generator=gen)

    got = serving_kernels.product(x.to(DEVICE), [w.to(DEVICE) for w in weights], starts)

    expected = binary.product_reference(x, weights, starts)
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-5, atol=1e-4)


def _variants(
    gen: torch.Generator, count: int, out: int, inn: int, group: int
) -> list[PackedTensor]:
    weights = []
    for _ in range(count):
        bits, scales = bitdelta.pack(torch.randn(out * inn, generator=gen), group)
        weights.append(PackedTensor((out, inn), bits, scales.half(), group))
    return weights


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("inn", "group"), [(256, 128), (40, 16)])
def test_accumulate_adds_into_the_rows_of_each_variant_in_one_launch(
    dtype: torch.dtype, inn: int, group: int
) -> None:
    """Rows scattered over the output, a row left to the base, a bfloat16 model's output: each
    variant's product lands in its rows, the others keep their values."""
    gen = torch.Generator().manual_seed(inn)
    weights = _variants(gen, 3, 70, inn, group)
    rows, starts = torch.tensor([6, 0, 3, 1, 4, 5]), [0, 2, 3, 6]  # row 2 uses the base
    x = torch.randn(7, inn, generator=gen).to(dtype)
    before = torch.randn(7, 70, generator=gen).to(dtype)
    out = before.clone().to(DEVICE)

    serving_kernels.accumulate(
        out, x.to(DEVICE), rows.to(DEVICE), [w.to(DEVICE) for w in weights], starts
    )

    expected = before.float()
    delta = binary.product_reference(x.float().index_select(0, rows), weights, starts)
    expected.index_add_(0, rows, delta)
    tolerance = {"rtol": 1e-5, "atol": 1e-4} if dtype == torch.float32 else {}
    torch.testing.assert_close(out.cpu(), expected.to(dtype), **tolerance)
    assert torch.equal(out[2].cpu(), before[2])


@pytest.mark.parametrize("per_row", [1, 2])  # a decode step; two positions of each row
def test_the_gemv_adds_each_rows_bias_delta_in_the_same_pass(
    per_row: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Batch rows 0, 2 and 3 of variants 0, 1, 1 (row 1 the base's): the output's rows of
    those get their product and their batch row's bias delta, the base's rows neither."""
    monkeypatch.setattr(serving_kernels, "GEMV_ROWS", 2 * per_row)
    gen = torch.Generator().manual_seed(per_row)
    weights = [w.to(DEVICE) for w in _variants(gen, 2, 70, 256, 128)]
    batch = [0, 2, 3]
    rows = torch.tensor([b * per_row + p for b in batch for p in range(per_row)])
    starts = [0, per_row, 3 * per_row]
    x = torch.randn(4 * per_row, 256, generator=gen)
    before = torch.randn(4 * per_row, 70, generator=gen)
    bias = torch.randn(4, 70, generator=gen)
    bias[1] = 7.0  # the base row's entry: never read
    out = before.clone().to(DEVICE)

    added = serving_kernels.accumulate(
        out, x.to(DEVICE), rows.to(DEVICE), weights, starts, bias=bias.to(DEVICE)
    )

    assert added
    expected = before.clone()
    delta = binary.product_reference(
        x.index_select(0, rows), [w.to("cpu") for w in weights], starts
    )
    expected.index_add_(0, rows, delta + bias[rows // per_row])
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-5, atol=1e-4)


def test_signs_off_a_16_byte_boundary_take_the_tiled_dot_and_leave_the_bias() -> None:
    gen = torch.Generator().manual_seed(9)
    (whole,) = _variants(gen, 1, 64, 128, 128)
    shifted = torch.empty(whole.bits.numel() + 1, dtype=torch.uint8, device=DEVICE)
    shifted[1:] = whole.bits.to(DEVICE)
    scales = whole.scales.to(DEVICE)
    odd = PackedTensor(whole.shape, shifted[1:], scales, whole.group)  # 1 byte off
    x = torch.randn(1, 128, generator=gen)
    out = torch.zeros(1, 64, device=DEVICE)
    table = serving_kernels.table([odd])
    one_row = torch.tensor([0], device=DEVICE)
    bias = torch.ones(1, 64, device=DEVICE)

    added = serving_kernels.accumulate(out, x.to(DEVICE), one_row, [odd], [0, 1], table, bias)

    assert not table.aligned and not added
    expected = binary.product_reference(x, [whole], [0, 1])
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-5, atol=1e-4)


def test_variants_of_different_group_sizes_in_one_batch() -> None:
    gen = torch.Generator().manual_seed(5)
    weights = _variants(gen, 1, 32, 128, 128) + _variants(gen, 1, 32, 128, 16)
    x = torch.randn(3, 128, generator=gen)

    got = serving_kernels.product(x.to(DEVICE), [w.to(DEVICE) for w in weights], [0, 2, 3])

    expected = binary.product_reference(x, weights, [0, 2, 3])
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("group", [128, 24])
def test_add_rows_adds_each_positions_looked_up_delta_row(group: int) -> None:
    """An embedding's rows: position p of variant k gets row ids[p] of D_k, in one launch."""
    gen = torch.Generator().manual_seed(group)
    weights = _variants(gen, 2, 50, 96, group)  # a vocabulary of 50 tokens of width 96
    ids = torch.randint(0, 50, (6,), generator=gen)
    rows, starts = torch.tensor([4, 0, 5, 2]), [0, 1, 4]  # positions 1 and 3: the base
    before = torch.randn(6, 96, generator=gen)
    out = before.clone().to(DEVICE)

    serving_kernels.add_rows(
        out, ids.to(DEVICE), rows.to(DEVICE), [w.to(DEVICE) for w in weights], starts
    )

    expected = before.clone()
    for k, w in enumerate(weights):
        mine = rows[starts[k] : starts[k + 1]]
        expected[mine] += w.decode_rows(ids[mine])
    torch.testing.assert_close(out.cpu(), expected)
    assert torch.equal(out[[1, 3]].cpu(), before[[1, 3]])
