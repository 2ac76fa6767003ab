"""The 1-bit products of variants against dense matmuls of the decoded deltas."""

import sys

import pytest
import torch

from zoo_gym.compression import bitdelta
from zoo_gym.serving import binary
from zoo_gym.serving.packed import PackedTensor


def _packed(out: int, inn: int, group: int, seed: int, dtype: torch.dtype) -> PackedTensor:
    delta = torch.randn(out * inn, generator=torch.Generator().manual_seed(seed))
    bits, scales = bitdelta.pack(delta, group)
    return PackedTensor((out, inn), bits, scales.to(dtype), group)


def _dense(packed: PackedTensor) -> torch.Tensor:
    """The delta by hand: scale of each value's group, signed by its bit (MSB first)."""
    flat = torch.arange(packed.numel)
    bit = (packed.bits.long()[flat // 8] >> (7 - flat % 8)) & 1
    scale = packed.scales.float()[flat // packed.group]
    return torch.where(bit.bool(), scale, -scale).view(packed.shape)


@pytest.mark.parametrize(
    ("out", "inn", "group"),
    [
        (40, 64, 128),  # a group spans two rows
        (24, 40, 16),  # rows of 2.5 groups: groups start mid-row
        (36, 256, 128),  # two groups per row, outputs not a multiple of 4
        (8, 24, 8),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_compiled_and_reference_products_match_dense_matmuls(
    out: int, inn: int, group: int, dtype: torch.dtype
) -> None:
    weights = [_packed(out, inn, group, seed, dtype) for seed in range(3)]
    starts = [0, 2, 2, 5]  # the second variant has no rows
    x = torch.randn(5, inn, generator=torch.Generator().manual_seed(9))
    expected = torch.cat(
        [x[starts[k] : starts[k + 1]] @ _dense(w).T for k, w in enumerate(weights)]
    )

    reference = binary.product_reference(x, weights, starts)
    compiled = binary.product(x, weights, starts, threads=2)

    torch.testing.assert_close(reference, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(compiled, expected, rtol=1e-5, atol=1e-5)


def test_the_compiled_kernel_is_built_here() -> None:
    assert binary.compiled_available(), "build it: python setup.py build_ext --inplace"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_the_kernel_threads_are_torchs_openmp_team() -> None:
    """Threads of its own ran beside torch's spinning OpenMP workers (a step of 100 variants'
    products in the 0.5B model: 823 ms, against 640 ms with the workers told not to spin):
    the kernel runs on the OpenMP runtime the process already has."""
    module = binary._COMPILED.module
    assert module is not None and module.threads == "openmp"
    weights = [_packed(64, 256, 128, seed, torch.float16) for seed in range(2)]
    binary.product(torch.randn(4, 256), weights, [0, 2, 4], threads=2)
    with open("/proc/self/maps") as maps:
        runtimes = {line.split()[-1] for line in maps if "gomp" in line.rsplit("/", 1)[-1]}
    assert len(runtimes) == 1, runtimes


def test_shapes_the_kernel_does_not_take_go_through_the_reference() -> None:
    weights = [_packed(6, 12, 4, 0, torch.float16)]  # neither in nor group a multiple of 8
    x = torch.randn(3, 12, generator=torch.Generator().manual_seed(2))

    assert not binary.compiled_for(weights[0], x.device)
    torch.testing.assert_close(
        binary.product(x, weights, [0, 3]), x @ _dense(weights[0]).T, rtol=1e-5, atol=1e-5
    )


def test_decoded_rows_are_those_of_the_whole_delta() -> None:
    packed = _packed(30, 20, 16, 4, torch.float16)  # rows of 20 values: bytes straddle rows
    index = torch.tensor([[3, 0], [29, 3]])

    rows = packed.decode_rows(index)

    torch.testing.assert_close(rows, _dense(packed)[index.reshape(-1)], rtol=0, atol=0)
    torch.testing.assert_close(packed.decode(), _dense(packed), rtol=0, atol=0)


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("layout", ["rows", "kernel"])
@pytest.mark.parametrize(
    ("out", "inn", "group", "dtype"),
    [
        (40, 64, 128, torch.float16),  # a group spans two rows
        (52, 256, 128, torch.float16),  # blocks of 16 and 8 outputs and single ones
        (76, 640, 128, torch.float16),  # 32 + 4 + 2 outputs; 64 of 80 bytes transposed
        (36, 96, 32, torch.bfloat16),
        (100, 128, 64, torch.float16),  # threads split at 32: 32 and 64 + 4 outputs
        (20, 40, 16, torch.float32),  # groups start mid-row
    ],
)
def test_accumulate_adds_each_variants_product_into_its_rows_of_the_output(
    compiled: bool, layout: str, out: int, inn: int, group: int, dtype: torch.dtype
) -> None:
    packed = [_packed(out, inn, group, seed, dtype) for seed in range(3)]
    weights = [binary.kernel_layout(w) for w in packed] if layout == "kernel" else packed
    rows = torch.tensor([5, 0, 6, 2, 3])  # variant 0: rows 5 and 0, 1: none, 2: 6, 2, 3
    starts = [0, 2, 2, 5]
    gen = torch.Generator().manual_seed(3)
    x, base = torch.randn(7, inn, generator=gen), torch.randn(7, out, generator=gen)
    expected = base.clone()
    for k, w in enumerate(packed):
        mine = rows[starts[k] : starts[k + 1]]
        expected[mine] += binary.product_reference(x[mine], [w], [0, len(mine)])
    previous = binary.use_compiled(compiled)
    try:
        got = base.clone()
        binary.accumulate(got, x, rows, binary.operands(weights), starts, threads=2)
    finally:
        binary.use_compiled(previous)

    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[[1, 4]], base[[1, 4]], rtol=0, atol=0)  # rows of no variant


def test_interleaved_signs_lie_16_rows_side_by_side_and_decode_the_same() -> None:
    packed = _packed(37, 96, 32, 5, torch.float16)  # 2 whole blocks of 16 rows and 5 more
    lanes = packed.interleaved()
    row_bytes = 96 // 8

    assert lanes.lanes and binary.reads_lanes(packed)
    for block, lane, word in [(0, 0, 0), (0, 15, 2), (1, 7, 1)]:
        at = block * 16 * row_bytes + 64 * word + 4 * lane
        row = (16 * block + lane) * row_bytes + 4 * word
        assert torch.equal(lanes.bits[at : at + 4], packed.bits[row : row + 4])
    assert torch.equal(lanes.bits[32 * row_bytes :], packed.bits[32 * row_bytes :])  # the rest
    assert torch.equal(lanes.row_bits(), packed.bits)
    assert lanes.to("cpu").lanes and lanes.interleaved() is lanes
    torch.testing.assert_close(lanes.decode(), _dense(packed), rtol=0, atol=0)
    index = torch.tensor([[0, 15], [16, 36], [31, 32]])
    torch.testing.assert_close(
        lanes.decode_rows(index), _dense(packed)[index.reshape(-1)], rtol=0, atol=0
    )


def test_signs_that_start_off_a_word_boundary_interleave_the_same() -> None:
    """Signs read from a file lie where its envelope puts them: an offset of one byte gives
    the layout an aligned copy gives."""
    packed = _packed(37, 96, 32, 5, torch.float16)
    shifted = torch.empty(packed.bits.numel() + 1, dtype=torch.uint8)
    shifted[1:] = packed.bits
    unaligned = PackedTensor(packed.shape, shifted[1:], packed.scales, packed.group)

    assert unaligned.bits.storage_offset() == 1
    assert torch.equal(unaligned.interleaved().bits, packed.interleaved().bits)
    assert torch.equal(unaligned.interleaved().row_bits(), packed.bits)


def test_only_matrices_of_whole_words_a_row_are_interleaved() -> None:
    odd = _packed(32, 40, 8, 0, torch.float16)  # rows of 5 bytes

    assert odd.interleaved() is odd and not binary.reads_lanes(odd)
    assert not binary.reads_lanes(_packed(32, 64, 128, 0, torch.float16))  # groups span rows


def test_the_kernel_refuses_interleaved_bits_it_cannot_read_so() -> None:
    module = binary._COMPILED.module
    assert module is not None
    weight = _packed(32, 64, 16, 0, torch.float16).interleaved()  # groups of 16: masked adds
    x, out = torch.randn(1, 64), torch.zeros(1, 32)
    scales = [weight.scales.view(torch.int16).numpy()]
    args = (x.numpy(), out.numpy(), torch.zeros(1, dtype=torch.int64).numpy(), [0, 1])

    with pytest.raises(ValueError, match="interleaved by lanes need the AVX-512 kernel"):
        module.accumulate(*args, [weight.bits.numpy()], scales, 64, 16, 0, 1, True)


def test_the_kernel_refuses_rows_outside_the_output() -> None:
    weights = [_packed(8, 16, 8, 0, torch.float16)]
    x, out = torch.randn(2, 16), torch.zeros(2, 8)

    with pytest.raises(ValueError, match="rows must index rows of x and out"):
        binary.accumulate(out, x, torch.tensor([2]), binary.operands(weights), [0, 1])


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("layout", ["rows", "kernel"])
@pytest.mark.parametrize(
    ("cols", "group", "dtype"),
    [(96, 32, torch.float16), (64, 128, torch.bfloat16), (40, 8, torch.float32)],
)
def test_add_rows_adds_each_positions_delta_row_of_its_variant(
    compiled: bool, layout: str, cols: int, group: int, dtype: torch.dtype
) -> None:
    """An embedding of 37 rows (two whole blocks of 16 and 5 more), three variants: each
    position's output row gets its token's delta row of its variant, the others keep theirs."""
    packed = [_packed(37, cols, group, seed, dtype) for seed in range(3)]
    weights = [binary.kernel_layout(w) for w in packed] if layout == "kernel" else packed
    ids = torch.tensor([15, 7, 36, 16, 8, 31, 32])  # a token per position (row of out)
    rows, starts = torch.tensor([6, 2, 0, 5, 3]), [0, 2, 2, 5]  # positions 1 and 4: the base
    base = torch.randn(7, cols, generator=torch.Generator().manual_seed(1))
    expected = base.clone()
    for k, w in enumerate(packed):
        for r in rows[starts[k] : starts[k + 1]]:
            expected[r] += _dense(w)[ids[r]]
    previous = binary.use_compiled(compiled)
    try:
        got = base.clone()
        binary.add_rows(got, ids, rows, binary.operands(weights), starts)
    finally:
        binary.use_compiled(previous)

    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[[1, 4]], base[[1, 4]], rtol=0, atol=0)


def test_add_rows_refuses_a_token_outside_the_embedding() -> None:
    weights = [_packed(8, 16, 8, 0, torch.float16)]
    out = torch.zeros(2, 16)

    with pytest.raises(ValueError, match="their ids rows of the weights"):
        binary.add_rows(
            out, torch.tensor([0, 8]), torch.tensor([1]), binary.operands(weights), [0, 1]
        )
