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
    chunk = bitdelta._chunk_len(group)
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
