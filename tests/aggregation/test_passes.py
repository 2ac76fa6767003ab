"""The compiled passes (`zoo_gym/aggregation/_passes.c`): sums of rows and the shifted Gram
product, against the NumPy and GEMM paths they replace and against exact values.

Sums of equal weights must be the NumPy path's bits; the Gram product of small integers is
exact (every shifted value, product and float32 lane sum is an integer below 2^24), so it is
compared for equality with int64 arithmetic; random values to float32 rounding.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TypeVar

import numpy as np
import pytest
import torch

from zoo_gym.aggregation import _core, krum
from zoo_gym.aggregation._core import mean_of_rows, squared_distances, weighted_sum
from zoo_gym.aggregation.columns import TensorColumns

try:
    from zoo_gym.aggregation import _passes
except ImportError:  # the build failed: test_the_development_install_built_the_extension fails
    _passes = None

T = TypeVar("T")

compiled = pytest.mark.skipif(_passes is None, reason="the C extension was not built")
gram_kernel = pytest.mark.skipif(
    _passes is None or not _passes.GRAM, reason="the compiled Gram product needs AVX-512"
)


@pytest.fixture(autouse=True)
def _compiled_on() -> Iterator[None]:
    yield
    _core.use_compiled_passes(True)


def _both(fn: Callable[[], T]) -> tuple[T, T]:
    """fn() with the compiled passes, then without them."""
    _core.use_compiled_passes(True)
    ours = fn()
    _core.use_compiled_passes(False)
    theirs = fn()
    _core.use_compiled_passes(True)
    return ours, theirs


def _shifted_gram(x: np.ndarray, ref: int, extra: np.ndarray | None) -> np.ndarray:
    """The lower triangle of S S^T in int64 for integer-valued x (rows minus row ref, the
    extra point as the last row)."""
    s = x.astype(np.int64) - x[ref].astype(np.int64)
    if extra is not None:
        s = np.vstack([s, extra.astype(np.int64) - x[ref].astype(np.int64)])
    return np.tril(s @ s.T).astype(np.float64)


def test_the_development_install_built_the_extension() -> None:
    # a compiler was present where the package was installed (CI, development)
    assert _passes is not None


@compiled
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("c", [1, 15, 1_023, 1_024, 1_025, 5_000])
def test_equal_weights_are_the_numpy_paths_bits(dtype: torch.dtype, c: int) -> None:
    # a column range of a wider tensor: rows lie d values apart
    x = torch.randn(9, c + 37, generator=torch.Generator().manual_seed(c)).to(dtype)[:, 5 : 5 + c]
    rows = [0, 3, 5, 8]
    ours, theirs = _both(lambda: mean_of_rows(TensorColumns(x, budget=1 << 20), rows))
    acc = torch.zeros(c, dtype=torch.float64)
    for i in rows:
        acc += x[i].double()
    assert torch.equal(ours, theirs)
    assert torch.equal(ours, (acc * 0.25).float())


@compiled
def test_rows_are_added_in_the_order_given_repeats_included() -> None:
    assert _passes is not None
    rng = np.random.default_rng(1)
    # four decades: every float64 addition rounds, so the order shows
    x = (rng.standard_normal((6, 3_001)) * 10.0 ** rng.uniform(-2, 2, (6, 3_001))).astype(
        np.float32
    )
    rows = np.array([5, 0, 3, 3, 1], dtype=np.int64)
    out = np.empty(3_001, dtype=np.float32)
    _passes.row_sum(x, "f", rows, None, 0.2, out)
    acc = np.zeros(3_001)
    for i in rows:
        np.add(acc, x[i], out=acc)
    assert np.array_equal(out, (acc * 0.2).astype(np.float32))


@compiled
def test_unequal_weights_add_one_fused_product_per_row() -> None:
    x = torch.randn(6, 9_999, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    w = torch.tensor([0.3, 0.0, 1e-3, 0.7, -0.25, 1.0 / 3.0], dtype=torch.float64)
    ours, theirs = _both(lambda: weighted_sum(x, w))
    expected = (w[:, None] * x).sum(dim=0).float()
    assert torch.allclose(ours, expected, rtol=1e-6, atol=1e-7)
    assert torch.allclose(ours, theirs, rtol=1e-6, atol=1e-7)


@compiled
def test_no_rows_sum_to_zero_and_bad_arguments_get_one_line() -> None:
    assert _passes is not None
    x = np.ones((3, 10), dtype=np.float32)
    out = np.full(10, 7.0, dtype=np.float32)
    _passes.row_sum(x, "f", np.zeros(0, dtype=np.int64), None, 0.0, out)
    assert not out.any()
    with pytest.raises(IndexError, match="row index is outside x"):
        _passes.row_sum(x, "f", np.array([3], dtype=np.int64), None, 1.0, out)
    with pytest.raises(ValueError, match="8-byte values"):
        _passes.row_sum(x, "d", np.array([0], dtype=np.int64), None, 1.0, out)
    with pytest.raises(ValueError, match="kind must be one of"):
        _passes.row_sum(x, "q", np.array([0], dtype=np.int64), None, 1.0, out)
    with pytest.raises(ValueError, match="rows must be contiguous"):
        _passes.row_sum(x[:, ::2], "f", np.array([0], dtype=np.int64), None, 1.0, out[:5])
    with pytest.raises(ValueError, match="out must hold c float32"):
        _passes.row_sum(x, "f", np.array([0], dtype=np.int64), None, 1.0, out[:5])


@gram_kernel
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 13, 50, 67])
@pytest.mark.parametrize("c", [1, 17, 1_000, 3_333])
@pytest.mark.parametrize("extra", ["none", "origin", "point"])
def test_gram_of_small_integers_is_exact(m: int, c: int, extra: str) -> None:
    assert _passes is not None
    rng = np.random.default_rng(m * 10_000 + c)
    x = rng.integers(-20, 21, (m, c + 3)).astype(np.float32)[:, 2 : 2 + c]
    ref = m // 2
    point = rng.integers(-20, 21, c).astype(np.float32) if extra == "point" else None
    given = point if extra == "point" else ("origin" if extra == "origin" else None)
    k = m + (extra != "none")
    g = np.full((k, k), 0.5)  # adds to what is there
    _passes.gram(x, "f", ref, given, g)
    zero = np.zeros(c, dtype=np.float32)
    expected = _shifted_gram(
        x, ref, point if extra == "point" else (zero if extra == "origin" else None)
    )
    assert np.array_equal(np.tril(g) - np.tril(np.full((k, k), 0.5)), expected)
    assert np.array_equal(np.triu(g, 1), np.triu(np.full((k, k), 0.5), 1))  # upper untouched


@gram_kernel
def test_gram_of_random_values_to_float32_rounding() -> None:
    assert _passes is not None
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((40, 100_003)) * 1e-3 + 5.0).astype(np.float32)
    g = np.zeros((40, 40))
    _passes.gram(x, "f", 11, None, g)
    s = (x - x[11]).astype(np.float64)  # the shift is float32, as the GEMM path's
    expected = np.tril(s @ s.T)
    assert np.abs(g - expected).max() <= 1e-5 * np.abs(expected).max()


@gram_kernel
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_rows_are_multiplied_as_their_float32_values(dtype: torch.dtype) -> None:
    assert _passes is not None
    x = torch.randn(21, 4_099, generator=torch.Generator().manual_seed(4)).to(dtype)
    point = torch.randn(4_099, generator=torch.Generator().manual_seed(5))
    code, bits = ("e", x.numpy()) if dtype == torch.float16 else ("b", x.view(torch.int16).numpy())
    half, single = np.zeros((22, 22)), np.zeros((22, 22))
    _passes.gram(bits, code, 3, point.numpy(), half)
    _passes.gram(x.float().numpy(), "f", 3, point.numpy(), single)
    assert np.array_equal(half, single)


@gram_kernel
def test_gram_refuses_bad_arguments_in_one_line() -> None:
    assert _passes is not None
    x = np.ones((3, 10), dtype=np.float32)
    with pytest.raises(IndexError, match="ref is outside x"):
        _passes.gram(x, "f", 3, None, np.zeros((3, 3)))
    with pytest.raises(ValueError, match=r"g must be \(k, k\) float64"):
        _passes.gram(x, "f", 0, "origin", np.zeros((3, 3)))
    with pytest.raises(ValueError, match="extra must hold c float32"):
        _passes.gram(x, "f", 0, np.zeros(9, dtype=np.float32), np.zeros((4, 4)))
    with pytest.raises(ValueError, match="kind must be one of 'feb'"):
        _passes.gram(x, "d", 0, None, np.zeros((3, 3)))


@gram_kernel
@pytest.mark.parametrize("threads", [1, 2])
def test_distances_from_either_engine_agree_and_do_not_depend_on_threads(threads: int) -> None:
    g = torch.Generator().manual_seed(6)
    x = torch.randn(60, 300_001, generator=g) * 1e-3 + torch.randn(300_001, generator=g)
    x[:5] += 0.5  # far updates
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        ours, theirs = _both(lambda: squared_distances(x))
        torch.set_num_threads(3 - threads)
        other = squared_distances(x)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(ours, other)
    # the far updates' distances of about 7.5e4 leave both engines about 1e-7 of that
    # (float32 products) on the near ones, of about 0.6
    assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-7 * float(theirs.max()))


@gram_kernel
def test_multi_krum_is_the_same_from_either_engine() -> None:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(30, 200_000, generator=g) * 1e-2
    x[:4] += 3e-3  # four attackers, close together, off the others
    ours, theirs = _both(lambda: krum(x, f=4, m=20))
    assert [d.selected for d in ours.decisions] == [d.selected for d in theirs.decisions]
    assert not any(d.selected for d in ours.decisions[:4])
    assert torch.equal(ours.vector, theirs.vector)  # the same rows, summed in the same order
    for a, b in zip(ours.decisions, theirs.decisions, strict=True):
        assert a.score == pytest.approx(b.score, rel=1e-5)
