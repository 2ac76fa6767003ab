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
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_the_kernel_can_run_here() -> None:
    assert DEVICE == "cuda" or kernels.interpreted(), "TRITON_INTERPRET=1 was not set"


@pytest.mark.parametrize(
    ("rows", "out", "inn", "group"),
    [
        ((3, 0, 17), 40, 64, 128),  # a group spans two rows; a variant without rows
        ((5, 2), 33, 40, 16),  # groups start mid-row; edges of every block
        ((1,), 64, 96, 8),
    ],
)
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32])
def test_binary_gemm_matches_the_reference(
    rows: tuple[int, ...], out: int, inn: int, group: int, scale_dtype: torch.dtype
) -> None:
    from zoo_gym.serving import kernels as serving_kernels

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
