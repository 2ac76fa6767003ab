"""The cache-blocked Gram matrix on CPU and the one-thread workers it runs on.

Small integer updates give exact distances whatever the blocking (every shifted value,
product and chunk sum is an integer below 2^24), so the distances are compared for
equality with the int64 ones across block boundaries of n, scratch blocks within a chunk
and chunks dealt out among threads.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from zoo_gym.aggregation import _core
from zoo_gym.aggregation._core import (
    _gram_plan,
    mean_of_rows,
    run_workers,
    squared_distances,
    weighted_sum,
)
from zoo_gym.aggregation.columns import TensorColumns


def exact_distances(x: torch.Tensor) -> torch.Tensor:
    xi = x.to(torch.int64)
    diff = xi[:, None, :] - xi[None, :, :]
    return (diff * diff).sum(dim=2).to(torch.float64)


def small_integers(seed: int, n: int, d: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-3, 4, (n, d), generator=g).float()
    x[: max(1, n // 5)] += 40.0  # far updates: the medoid reference is not update 0
    return x


@pytest.mark.parametrize("n", [1, 2, 15, 16, 17, 31, 33, 48, 50, 65])
def test_lower_blocks_cover_the_lower_triangle_once(n: int) -> None:
    plan = _gram_plan(n, torch.float32, torch.device("cpu"), 10_000)
    covered = torch.zeros((n, n), dtype=torch.int64)
    for i0, i1 in plan.blocks:
        covered[i0:, i0:i1] += 1
    assert torch.equal(torch.tril(covered), torch.tril(torch.ones((n, n), dtype=torch.int64)))
    assert all(i1 - i0 in (16, 32) for i0, i1 in plan.blocks[:-1])  # only the last is narrow


def test_scratch_is_a_few_mib_of_whole_blocks_and_never_wider_than_a_chunk() -> None:
    cpu = torch.device("cpu")
    assert _gram_plan(50, torch.float32, cpu, 100_000).width == 6144  # 1.2 MiB
    assert _gram_plan(300, torch.float32, cpu, 100_000).width == 4352  # 5 MiB
    assert _gram_plan(1000, torch.float32, cpu, 100_000).width == 1280
    assert _gram_plan(1000, torch.float64, cpu, 100_000).width == 1024  # at least
    assert _gram_plan(50, torch.float32, cpu, 700).width == 700


@pytest.fixture(params=["compiled", "gemm"])
def engine(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each test of the Gram product with the compiled kernel (where it runs) and the GEMM."""
    _core.use_compiled_passes(request.param == "compiled")
    yield request.param
    _core.use_compiled_passes(True)


@pytest.mark.parametrize("n", [3, 17, 33, 50])
@pytest.mark.parametrize("threads", [1, 2])
def test_blocked_distances_of_small_integers_are_exact(
    n: int, threads: int, engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # scratch blocks of 256 columns in chunks of a few hundred to a few thousand columns
    monkeypatch.setattr(_core, "_GRAM_SCRATCH_COLUMNS", (256, 256))
    x = small_integers(n, n, 9_001)
    expected = exact_distances(x)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        whole = squared_distances(x)
        narrow = squared_distances(TensorColumns(x, budget=n * 8 * 700))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(whole, expected)
    assert torch.equal(narrow, expected)


def test_half_precision_is_shifted_in_the_working_dtype(
    engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_core, "_GRAM_SCRATCH_COLUMNS", (256, 256))
    x = small_integers(5, 20, 3_000)
    assert torch.equal(squared_distances(x.to(torch.bfloat16)), exact_distances(x))


def test_workers_run_torch_on_one_thread_and_give_the_count_back() -> None:
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        seen = run_workers(lambda item: (item, torch.get_num_threads()), [0, 1, 2, 3], 2)
        after = torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
    assert seen == [(0, 1), (1, 1), (2, 1), (3, 1)]  # in item order
    assert after == 2


def test_a_failing_worker_still_gives_the_count_back() -> None:
    def fail(item: int) -> int:
        raise RuntimeError(f"item {item}")

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with pytest.raises(RuntimeError, match="item"):
            run_workers(fail, [0, 1], 2)
        after = torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
    assert after == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_equal_weights_sum_the_rows_in_order_then_scale(dtype: torch.dtype) -> None:
    x = torch.randn(7, 70_001, generator=torch.Generator().manual_seed(6)).to(dtype)
    rows = [0, 2, 3, 6]
    acc = torch.zeros(70_001, dtype=torch.float64)
    for i in rows:
        acc += x[i].double()
    assert torch.equal(mean_of_rows(x, rows), (acc * 0.25).float())


def test_unequal_weights_add_each_scaled_row_in_order() -> None:
    x = torch.randn(5, 70_001, generator=torch.Generator().manual_seed(7))
    w = torch.tensor([0.5, 0.0, 0.25, 0.125, 0.125], dtype=torch.float64)
    acc = torch.zeros(70_001, dtype=torch.float64)
    for i in (0, 2, 3, 4):
        acc.add_(x[i].double(), alpha=float(w[i]))
    assert torch.equal(weighted_sum(x, w), acc.float())


def test_the_mean_of_one_row_is_that_row() -> None:
    x = torch.randn(4, 1_000, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    assert torch.equal(mean_of_rows(x, [2]), x[2].float())


def test_medoid_reads_the_lower_triangle_only() -> None:
    x = torch.randn(40, 30, dtype=torch.float64, generator=torch.Generator().manual_seed(10))
    x[:8] += 5.0
    full = x @ x.T
    expected = int(torch.cdist(x, x).sum(dim=1).argmin())
    garbage = torch.tril(full) + torch.triu(torch.full_like(full, 1e9), 1)
    assert _core._medoid(garbage) == expected


@pytest.mark.parametrize("slices", [1, 2, 3, 16])
@pytest.mark.parametrize("add", [False, True])
def test_a_product_cut_into_slices_equals_the_whole_product(slices: int, add: bool) -> None:
    # small integers: every product and sum is exact, whatever the slices and their order;
    # `a` a padded view of a wider scratch, as the Gram pass hands it over (GPU path)
    g = torch.Generator().manual_seed(11)
    scratch = torch.randint(-3, 4, (9, 1_013 + 16), generator=g).float()
    a = scratch[:, :1_013]
    start = torch.randint(-5, 6, (9, 9), generator=g).float()
    out = start.clone()
    _core._sliced_product(a, a.T, out, add, slices)
    whole = a.to(torch.int64) @ a.T.to(torch.int64)
    assert torch.equal(out.to(torch.int64), whole + start.to(torch.int64) if add else whole)


def test_the_product_is_sliced_off_the_cpu_only_where_the_columns_and_memory_allow() -> None:
    # a chunk of an H200's budget at n = 1,000 (268,288 columns): 16 slices of 64 MiB of
    # products in all; a chunk of 4,096 columns, or rows whose products would take over
    # 256 MiB each, stay one GEMM
    assert _core._slices(1_000, 268_288, 1_000) == 16
    assert _core._slices(1_000, 4_096 * 3 + 5, 1_000) == 3
    assert _core._slices(1_000, 4_096, 1_000) == 1
    assert _core._slices(8_192, 268_288, 8_192) == 1


@pytest.mark.parametrize("weights", [[0.25] * 4, [1.0], [0.5, 0.25, 0.125, 0.125]])
def test_a_chunk_sum_off_the_cpu_is_the_float64_sum(weights: list[float]) -> None:
    # the reduction the GPU runs per chunk, run here on the CPU: against the float64 sum of
    # the same rows (exact for these values, so any order gives these bits)
    g = torch.Generator().manual_seed(12)
    chunk = torch.randint(-1000, 1000, (6, 5_001), generator=g).float() / 64
    rows = [5, 1, 2, 4][: len(weights)]
    pairs = list(zip(rows, weights, strict=True))
    out = torch.empty(5_001)
    _core._sum_accelerator(chunk, pairs, out)
    expected = sum(w * chunk[i].double() for i, w in pairs)
    assert torch.equal(out, torch.as_tensor(expected).float())
    whole = torch.empty(5_001)
    _core._sum_accelerator(
        chunk[rows[: len(weights)]], [(j, w) for j, w in enumerate(weights)], whole
    )
    assert torch.equal(whole, out)


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        line = next(row for row in status if row.startswith(field + ":"))
    return int(line.split()[1])


@pytest.mark.parametrize("weights", [[0.125] * 8, [0.5, 0.25, 0.0625, 0.0625] + [0.03125] * 4])
def test_a_chunk_sum_off_the_cpu_holds_one_span_in_float64_not_the_chunk(
    weights: list[float], monkeypatch: pytest.MonkeyPatch
) -> None:
    # 512 MiB of rows summed with spans of 8 MiB: the float64 copy of the whole chunk that a
    # sum with dtype=float64 makes would take 1 GiB (the heap keeps some freed spans: the
    # peak is a few spans, not one)
    monkeypatch.setattr(_core, "_SUM_SPAN_ACCELERATOR", 8 << 20)
    chunk = torch.ones(8, 1 << 24)
    out = torch.zeros(1 << 24)  # its pages in before the peak is reset
    pairs = list(enumerate(weights))
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # the peak resident set starts again from here
    before = _rss_kib("VmRSS")
    _core._sum_accelerator(chunk, pairs, out)
    extra_mib = (_rss_kib("VmHWM") - before) / 1024
    assert extra_mib < 256, extra_mib
    assert torch.equal(out, torch.full_like(out, sum(weights)))
