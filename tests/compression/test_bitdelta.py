import numpy as np
import pytest
import torch

from zoo_gym.compression import bitdelta


def _reference(x: torch.Tensor, group: int) -> tuple[bytes, torch.Tensor]:
    """Sign bytes and scales of one tensor, the plain way: numpy.packbits of ``x >= 0``; each
    group's |x| zero-padded to `group` values, summed by torch.sum and divided by its length."""
    n = x.numel()
    padded = torch.zeros(-(-n // group) * group)
    padded[:n] = x.abs()
    counts = torch.full((padded.numel() // group,), float(group))
    if n % group:
        counts[-1] = float(n % group)
    scales = torch.sum(padded.view(-1, group), 1).div_(counts)
    return np.packbits(x.numpy() >= 0).tobytes(), scales


@pytest.mark.parametrize("group", [3, 100, 128, 4096])
def test_pack_many_across_chunk_boundaries_matches_the_plain_computation(group: int) -> None:
    # Prepare: lengths around the chunk size, so tensors start, end and are cut mid-chunk
    chunk = bitdelta._chunk_len(group, bitdelta._PACK_CHUNK)
    sizes = [chunk - 5, 17, 2 * chunk + 3, 0, 1000, chunk, 9, 300_001]
    gen = torch.Generator().manual_seed(group)
    xs = [torch.randn(n, generator=gen) for n in sizes]
    xs[1][3] = -0.0

    # Execute
    packed, scales = bitdelta.pack_many(xs, group)

    # Assert: byte for byte and bit for bit
    expected = [_reference(x, group) for x in xs]
    assert [p.numpy().tobytes() for p in packed] == [bits for bits, _ in expected]
    assert torch.equal(scales, torch.cat([s for _, s in expected]))


def test_pack_many_reads_strided_and_half_precision_inputs_as_float32() -> None:
    gen = torch.Generator().manual_seed(0)
    strided = torch.randn(300, 257, generator=gen).t()[:, ::2]
    half = torch.randn(70_001, generator=gen).half()

    packed, scales = bitdelta.pack_many([strided, half], 64)

    flat = [strided.reshape(-1).contiguous(), half.float()]
    alone = [bitdelta.pack(x, 64) for x in flat]
    assert all(torch.equal(p, a) for p, (a, _) in zip(packed, alone, strict=True))
    assert torch.equal(scales, torch.cat([s for _, s in alone]))


@pytest.mark.parametrize("sizes", [[256, 1024, 128], [100, 3, 0, 257], [2 * 2**18 + 5, 40]])
def test_pack_concat_holds_each_tensors_bytes_at_its_offset(sizes: list[int]) -> None:
    # Prepare: whole groups (one flat vector), short tails (padding), a tensor across chunks
    gen = torch.Generator().manual_seed(len(sizes))
    xs = [torch.randn(n, generator=gen) for n in sizes]

    # Execute
    bits, starts, scales = bitdelta.pack_concat(xs, 128)

    # Assert
    expected = [_reference(x, 128) for x in xs]
    got = [bits[s : s + (n + 7) // 8].tobytes() for s, n in zip(starts, sizes, strict=True)]
    assert got == [b for b, _ in expected]
    assert torch.equal(scales, torch.cat([s for _, s in expected]))


def test_pack_concat_reads_shaped_tensors_that_require_grad() -> None:
    gen = torch.Generator().manual_seed(1)
    xs = [
        torch.randn(16, 64, generator=gen, requires_grad=True),
        torch.randn(3, 5, 7, generator=gen),
    ]

    bits, starts, scales = bitdelta.pack_concat(xs, 64)

    alone = [bitdelta.pack(x.detach().reshape(-1), 64) for x in xs]
    assert starts == [0, 16 * 64 // 8]
    assert bits[:128].tobytes() == alone[0][0].numpy().tobytes()
    assert bits[128 : 128 + 14].tobytes() == alone[1][0].numpy().tobytes()  # ceil(105 / 8)
    assert torch.equal(scales, torch.cat([s for _, s in alone]))
