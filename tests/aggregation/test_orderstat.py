"""The compiled median and trimmed mean (`zoo_gym/aggregation/_orderstat.c`) against the
NumPy and torch engines of `_select`, ties at the cuts and their shares included.

Results are compared on their raw float32 bits (so -0.0, NaN and the last bit of a float64
sum show), per-row counts exactly: the compiled engine must be the NumPy engine, faster.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from numpy.typing import NDArray

from zoo_gym.aggregation import _select
from zoo_gym.aggregation._select import coordinatewise, kept_sums

try:
    from zoo_gym.aggregation import _orderstat
except ImportError:  # the build failed: test_the_development_install_built_the_extension fails
    _orderstat = None

KERNELS: tuple[str, ...] = _orderstat.kernels if _orderstat is not None else ()
compiled = pytest.mark.skipif(_orderstat is None, reason="the C extension was not built")

# zeros of both signs, subnormals, and values near the ends of float32
SPECIALS = np.array([0.0, -0.0, 1e-45, -1e-45, 1e-40, 3e38, -3e38], dtype=np.float64)


@pytest.fixture(autouse=True)
def _one_thread_compiled_on(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # one thread: the float64 shares of tied runs are then added in one order by every engine
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    yield
    _select.use_compiled(True)


def _raw(x: torch.Tensor | NDArray[Any]) -> NDArray[np.int32]:
    """The float32 bits of `x` as int32."""
    a = x.numpy() if isinstance(x, torch.Tensor) else x
    return np.ascontiguousarray(a, dtype=np.float32).view(np.int32)


def _work(x: NDArray[Any]) -> NDArray[np.uint8]:
    """A work buffer for the kernels on `x` `(n, c)`."""
    assert _orderstat is not None
    return np.empty(_orderstat.work_size(*x.shape), dtype=np.uint8)


def _matrix(
    rng: np.random.Generator, n: int, c: int, ties: float, special: float, spread: float = 2.0
) -> NDArray[Any]:
    """(n, c) float64 values: normal ones spread over 2 x `spread` decades (a few decades
    make every float64 addition round, so that the order of a sum shows), a share `ties`
    drawn from five small integers (ties at the cuts), a share `special` from SPECIALS."""
    x = rng.standard_normal((n, c)) * 10.0 ** rng.uniform(-spread, spread, (n, c))
    draw = rng.random((n, c))
    x[draw < ties] = rng.integers(-2, 3, int((draw < ties).sum()))
    x[draw > 1.0 - special] = rng.choice(SPECIALS, int((draw > 1.0 - special).sum()))
    return x


def _engines(x: torch.Tensor, kind: str, f: int, width: int) -> list[tuple[torch.Tensor, Any]]:
    """(result, rows) of the compiled, NumPy and torch engines."""
    _select.use_compiled(True)
    ours = coordinatewise(x, kind, f, width, engine="numpy")
    _select.use_compiled(False)
    numpy_engine = coordinatewise(x, kind, f, width, engine="numpy")
    torch_engine = coordinatewise(x, kind, f, width, engine="torch")
    _select.use_compiled(True)
    return [ours, numpy_engine, torch_engine]


def test_the_development_install_built_the_extension() -> None:
    # A compiler was present where the package was installed (CI, development): the build must
    # not have failed silently into the NumPy engine.
    assert _select.compiled_available(), (
        "zoo_gym.aggregation._orderstat was not built: install a C compiler, then pip install -e ."
    )
    assert "portable" in KERNELS


@compiled
@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(1, 70),
    c=st.integers(1, 45),
    kind=st.sampled_from(["median", "trimmed"]),
    f_share=st.floats(0.0, 1.0),
    float64=st.booleans(),
    ties=st.sampled_from([0.0, 0.2, 0.9]),
    special=st.sampled_from([0.0, 0.1, 0.6]),
    width=st.sampled_from([3, 16, 64]),
    spread=st.sampled_from([0.0, 2.0, 30.0]),
    seed=st.integers(0, 2**32 - 1),
)
def test_compiled_equals_the_numpy_and_torch_engines_bit_for_bit(
    n: int,
    c: int,
    kind: str,
    f_share: float,
    float64: bool,
    ties: float,
    special: float,
    width: int,
    spread: float,
    seed: int,
) -> None:
    f = int(f_share * ((n - 1) // 2)) if kind == "trimmed" else 0
    x = _matrix(np.random.default_rng(seed), n, c, ties, special, spread)
    data = torch.from_numpy(x if float64 else x.astype(np.float32))
    (out, rows), (np_out, np_rows), (t_out, t_rows) = _engines(data, kind, f, width)
    assert np.array_equal(_raw(out), _raw(np_out))
    assert torch.equal(rows, np_rows)
    if kind == "trimmed" and f == 0:
        return  # a plain mean, no kernel: NumPy's np.sum and the torch engine's row loop
    assert np.array_equal(_raw(out), _raw(t_out))
    assert torch.allclose(rows, t_rows, rtol=1e-12, atol=1e-9)


@compiled
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(("n", "f"), [(1, 0), (2, 0), (3, 1), (50, 10), (101, 1), (101, 50)])
def test_every_kernel_gives_the_same_bits_on_a_view_with_strided_rows(
    kernel: str, dtype: type[np.floating[Any]], n: int, f: int
) -> None:
    # rows 100 values apart, 37 columns from column 5: two whole tiles and a partial one
    assert _orderstat is not None
    rng = np.random.default_rng(n)
    x = _matrix(rng, n, 100, 0.0, 0.0).astype(dtype)[:, 5:42]
    for kind in ("median", "trimmed") if f else ("median",):
        _select.use_compiled(False)
        ref, ref_rows = coordinatewise(torch.from_numpy(x), kind, f, 64, engine="numpy")
        out = np.zeros(37, dtype=np.float32)
        counts = np.zeros(n, dtype=np.int64)
        shares = np.zeros(n, dtype=np.float64)
        network = _select._network(n, kind, f)
        if kind == "median":
            tied = _orderstat.median(x, network, out, counts, shares, _work(x), kernel)
        else:
            tied = _orderstat.trimmed(x, f, network, out, counts, shares, _work(x), kernel)
        assert tied == 0  # no ties, no NaN
        assert np.array_equal(_raw(out), _raw(ref))
        assert np.array_equal(counts, ref_rows.numpy())


@compiled
@pytest.mark.parametrize(("n", "f"), [(1000, 100), (1031, 515), (4200, 1)])
def test_large_n_and_the_sum_order_of_long_rows(n: int, f: int) -> None:
    # 4,198 kept values reach the third level of torch.sum's cascade (256 quads of 16)
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, 19, generator=g) * 2.0 ** torch.randint(-8, 8, (n, 19), generator=g)
    for kind in ("median", "trimmed"):
        (out, rows), (np_out, np_rows), _ = _engines(x, kind, f, 64)
        assert np.array_equal(_raw(out), _raw(np_out))
        assert torch.equal(rows, np_rows)
    kept = torch.sort(x.double(), dim=0).values[f : n - f].T.contiguous()  # (c, k)
    sums = kept_sums(kept, torch.empty(19, dtype=torch.float64))
    out, _ = coordinatewise(x, "trimmed", f, 64)
    assert np.array_equal(_raw(out), _raw((sums / (n - 2 * f)).float()))


@compiled
def test_a_zero_median_is_positive_zero_whatever_the_zeros_signs() -> None:
    # columns of -0.0 and +0.0 in several arrangements; and a -0.0 between -1 and 2
    x = torch.tensor(
        [
            [-0.0, -0.0, 0.0, -0.0, -1.0],
            [-0.0, 0.0, -0.0, -0.0, 2.0],
            [-0.0, -0.0, -0.0, 0.0, -0.0],
        ]
    )
    for out, _ in _engines(x, "median", 0, 64):
        assert _raw(out).tolist() == [0] * 5  # +0.0


@compiled
@pytest.mark.parametrize("kernel", KERNELS)
def test_tied_columns_give_shares_and_a_nan_leaves_the_chunk_to_numpy(kernel: str) -> None:
    assert _orderstat is not None
    # column 0: 1, 3, 2 -> median 2, held by row 2; column 1: 2, 2, 7 -> the run of two 2s at
    # sorted positions [0, 2) holds the middle position 1, half each for rows 0 and 1; column
    # 2: 5, 6, 4 -> 5, row 0
    x = np.array([[1.0, 2.0, 5.0], [3.0, 2.0, 6.0], [2.0, 7.0, 4.0]], np.float32)
    out = np.zeros(3, dtype=np.float32)
    counts = np.zeros(3, dtype=np.int64)
    shares = np.zeros(3, dtype=np.float64)
    network = _select._network(3, "median", 0)
    assert _orderstat.median(x, network, out, counts, shares, _work(x), kernel) == 1
    assert out.tolist() == [2.0, 2.0, 5.0]
    assert counts.tolist() == [1, 0, 1]
    assert shares.tolist() == [0.5, 0.5, 0.0]
    x[1, 2] = np.nan
    assert _orderstat.median(x, network, out, counts, shares, _work(x), kernel) == -1
    assert counts.tolist() == [1, 0, 1]  # untouched
    (ours, rows), (np_out, np_rows), _ = _engines(torch.from_numpy(x), "median", 0, 64)
    assert np.array_equal(_raw(ours), _raw(np_out))
    assert torch.equal(rows, np_rows)


@compiled
@pytest.mark.parametrize(("n", "f"), [(100, 10), (1000, 100)])
def test_bitdelta_like_columns_full_of_ties(n: int, f: int) -> None:
    # decoded BitDelta updates: +-scale of each update's group, the scales few and repeated
    rng = np.random.default_rng(n)
    scales = rng.choice(np.float32([0.75, 0.8125, 0.875, 1.0, 1.25]), (n, 1))
    x = torch.from_numpy(np.where(rng.random((n, 300)) < 0.5, -scales, scales))
    for kind in ("median", "trimmed"):
        (out, rows), (np_out, np_rows), (t_out, t_rows) = _engines(x, kind, f, 128)
        assert np.array_equal(_raw(out), _raw(np_out))
        assert np.array_equal(_raw(out), _raw(t_out))
        assert torch.equal(rows, np_rows)
        assert torch.allclose(rows, t_rows, rtol=1e-12, atol=1e-9)


@compiled
def test_hand_computed_trimmed_mean_and_counts() -> None:
    assert _orderstat is not None
    # column 0: 10, 1, 4, 3, 2 -> drop 1 and 10, keep 2, 3, 4 -> 3.0; column 1: 5, 4, 3, 2, 1
    # -> drop 5 and 1 -> 3.0; row 0 loses a value in both columns, rows 1 and 4 in one
    x = np.array([[10.0, 5.0], [1.0, 4.0], [4.0, 3.0], [3.0, 2.0], [2.0, 1.0]], np.float32)
    out = np.zeros(2, dtype=np.float32)
    counts = np.zeros(5, dtype=np.int64)
    shares = np.zeros(5, dtype=np.float64)
    assert (
        _orderstat.trimmed(x, 1, _select._network(5, "trimmed", 1), out, counts, shares, _work(x))
        == 0
    )
    assert out.tolist() == [3.0, 3.0]
    assert counts.tolist() == [2, 1, 0, 0, 1]


@compiled
def test_bad_arguments_get_one_clear_line() -> None:
    assert _orderstat is not None
    x = np.zeros((4, 3), dtype=np.float32)
    out, counts, shares = np.zeros(3, np.float32), np.zeros(4, np.int64), np.zeros(4)
    with pytest.raises(ValueError, match="not a network for these n rows"):
        _orderstat.median(x, _orderstat.network(9, 0, 8), out, counts, shares, _work(x))
    with pytest.raises(ValueError, match="1 <= f < n / 2"):
        _orderstat.trimmed(x, 2, _orderstat.network(4, 0, 3), out, counts, shares, _work(x))
    with pytest.raises(TypeError, match="each row contiguous"):
        _orderstat.median(x[:, ::2], _orderstat.network(4, 0, 3), out, counts, shares, _work(x))
    with pytest.raises(TypeError, match="shares float64"):
        _orderstat.median(x, _orderstat.network(4, 0, 3), out, counts, shares[:2], _work(x))
    with pytest.raises(ValueError, match="work holds 10 bytes"):
        _orderstat.median(
            x, _orderstat.network(4, 0, 3), out, counts, shares, np.zeros(10, np.uint8)
        )
    with pytest.raises(ValueError, match="unknown kernel"):
        _orderstat.median(x, _orderstat.network(4, 0, 3), out, counts, shares, _work(x), "sse9")


@compiled
@pytest.mark.parametrize("n", [2, 3, 16, 17, 33])
def test_the_network_sorts_every_zero_one_input(n: int) -> None:
    # the 0-1 principle: a comparator network that sorts every 0/1 input sorts every input
    assert _orderstat is not None
    pairs = np.frombuffer(_orderstat.network(n, 0, n - 1), dtype=np.int32).reshape(-1, 2)
    if n <= 17:
        bits = (np.arange(2**n)[:, None] >> np.arange(n)) & 1  # every input
    else:
        bits = np.random.default_rng(0).integers(0, 2, (200_000, n))
    v = bits.astype(np.int8).T.copy()  # (n, inputs)
    for i, j in pairs:
        v[i], v[j] = np.minimum(v[i], v[j]), np.maximum(v[i], v[j])
    assert (np.diff(v, axis=0) >= 0).all()


def test_use_compiled_returns_the_previous_setting() -> None:
    available = _select.compiled_available()
    assert _select.use_compiled(False) is available
    assert _select.use_compiled(True) is False
    assert _select.use_compiled(True) is available


def _closest(
    x: NDArray[Any], beta: int, kernel: str | None = None
) -> tuple[NDArray[np.float32], NDArray[np.float64], int]:
    """Bulyan's second step by the compiled kernel: means, per-row numbers, tied columns."""
    assert _orderstat is not None
    n, c = x.shape
    out = np.full(c, np.nan, dtype=np.float32)
    counts, shares = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.float64)
    network = _orderstat.network(n, 0, n - 1)
    tied = _orderstat.closest(x, beta, network, out, counts, shares, _work(x), kernel)
    return out, counts + (shares if tied > 0 else 0.0), tied


@compiled
@settings(max_examples=150, deadline=None)
@given(
    theta=st.integers(1, 60),
    c=st.integers(1, 45),
    beta_share=st.floats(0.0, 1.0),
    float64=st.booleans(),
    ties=st.sampled_from([0.0, 0.2, 0.9]),
    special=st.sampled_from([0.0, 0.1, 0.6]),
    spread=st.sampled_from([0.0, 2.0, 30.0]),
    seed=st.integers(0, 2**32 - 1),
)
def test_bulyans_closest_values_equal_the_numpy_twin_bit_for_bit(
    theta: int,
    c: int,
    beta_share: float,
    float64: bool,
    ties: float,
    special: float,
    spread: float,
    seed: int,
) -> None:
    beta = 1 + int(beta_share * (theta - 1))
    x = _matrix(np.random.default_rng(seed), theta, c, ties, special, spread)
    data = x if float64 else x.astype(np.float32)
    v = data.astype(np.float64)
    np_mean, np_used = _select.np_closest_to_median(v, beta)
    # the torch twin (other devices) sums each column in an order of its own: its means are
    # not compared here (over 30 decades an order of the sum is a different number)
    _, t_used = _select.closest_to_median(torch.from_numpy(v), beta)
    for kernel in KERNELS:
        out, used, _ = _closest(data, beta, kernel)
        assert np.array_equal(_raw(out), _raw(np_mean)), kernel
        # the tie shares are added in another order than the twins add them
        np.testing.assert_allclose(used, np_used, rtol=1e-12, atol=1e-9)
        np.testing.assert_allclose(used, t_used.numpy(), rtol=1e-12, atol=1e-9)


@compiled
@pytest.mark.parametrize("kernel", KERNELS)
def test_bulyans_closest_values_by_hand_ties_shared_and_a_nan_left_to_numpy(kernel: str) -> None:
    # column 0: 0, 2, 3, 4, 5 -> median 3, distances 3, 1, 0, 1, 2; beta = 2 keeps 3 and shares
    # the last place between the tied 2 and 4: (3 + 2 / 2 + 4 / 2) / 2 = 3; column 1: 1, 9, 2,
    # 3, 8 -> median 3, distances 2, 6, 1, 0, 5: 3 and 2 -> 2.5; column 2: -0.0 everywhere:
    # +0.0
    x = np.array([[0, 1, -0.0], [2, 9, -0.0], [3, 2, -0.0], [4, 3, -0.0], [5, 8, -0.0]])
    out, used, tied = _closest(x.astype(np.float32), 2, kernel)
    assert tied == 2  # columns 0 and 2
    assert out.tolist() == [3.0, 2.5, 0.0] and _raw(out)[2] == 0  # +0.0
    # rows: column 0 gives 0, 0.5, 1, 0.5, 0; column 1 gives 0, 0, 1, 1, 0; column 2 (five
    # equal values, two places) 0.4 each
    np.testing.assert_allclose(used, [0.4, 0.9, 2.4, 1.9, 0.4], rtol=1e-15)
    x32 = x.astype(np.float32)
    x32[1, 1] = np.nan
    out, used, tied = _closest(x32, 2, kernel)
    assert tied == -1 and used.tolist() == [0] * 5  # counts untouched
    mean, share = _select.np_closest_to_median(x32.astype(np.float64), 2)
    closest = _select.Closest.of(5, 3)  # the NumPy twin takes the span
    assert closest is not None
    closest.span(x32, 2, out)
    assert np.array_equal(_raw(out), _raw(mean))
    assert closest.used().tolist() == share.tolist()


@compiled
@pytest.mark.parametrize("kernel", KERNELS)
def test_bulyans_kernel_reads_the_chosen_rows_where_they_are(kernel: str) -> None:
    assert _orderstat is not None
    rng = np.random.default_rng(7)
    x = _matrix(rng, 30, 77, 0.3, 0.05).astype(np.float32)
    rows = np.array([29, 3, 3, 17, 0, 8, 21, 12, 5, 26, 14], dtype=np.int64)
    expected, expected_used, tied = _closest(np.ascontiguousarray(x[rows]), 5, kernel)
    assert tied > 0  # the small integers tie
    out = np.empty(77, dtype=np.float32)
    counts, shares = np.zeros(11, dtype=np.int64), np.zeros(11)
    network = _orderstat.network(11, 0, 10)
    work = np.empty(_orderstat.work_size(11, 77), dtype=np.uint8)
    assert _orderstat.closest(x, 5, network, out, counts, shares, work, kernel, rows) == tied
    assert np.array_equal(_raw(out), _raw(expected))
    assert (counts + shares).tolist() == expected_used.tolist()
    with pytest.raises(ValueError, match="rows must be int64 indices of x's rows"):
        _orderstat.closest(x, 5, network, out, counts, shares, work, kernel, rows + 1)
    with pytest.raises(ValueError, match="rows must be int64 indices of x's rows"):
        _orderstat.closest(x, 5, network, out, counts, shares, work, kernel, rows.astype(np.int32))
    with pytest.raises(ValueError, match="need 1 <= beta <= n"):
        _orderstat.closest(x, 12, network, out, counts, shares, work, kernel, rows)
