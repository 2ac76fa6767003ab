"""Rules read through column sources: the same results as the in-memory tensor.

A tensor and a budget-less `TensorColumns` of it run the very same chunks (bit-equal
results). A source with a small budget cuts the updates into chunks of a few columns:
coordinate-wise results and weighted sums do not depend on the chunk width (each
coordinate is summed or sorted over the updates in the same order), so FedAvg, the
median, the trimmed mean and the means of the Krum family and Bulyan are bit-equal given
the same selection; distances sum over chunks in another order, so Krum scores, the
geometric median and centered clipping agree to a relative 1e-5 with the same decisions.
NNM of a source agrees with the in-memory NNM to float rounding (see the test).
"""

from __future__ import annotations

from dataclasses import astuple
from typing import Any

import pytest
import torch

from zoo_gym.aggregation import RULES, Aggregate, aggregate, clip_updates, min_clients, nnm
from zoo_gym.aggregation.columns import Columns, TensorColumns, cached

PARAMS: dict[str, dict[str, Any]] = {"centered_clipping": {"tau": 1.0}}
#: rules whose vector is bit-equal whatever the chunk width (given the same selection)
EXACT = {"fedavg", "krum", "multikrum", "bulyan", "median", "trimmed_mean"}


def col(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)[:, None]


def assert_same(a: Aggregate, b: Aggregate, *, exact: bool) -> None:
    """Same decisions; the vectors bit-equal when `exact`, else within float tolerance."""
    if exact:
        assert torch.equal(a.vector, b.vector)
    else:
        assert torch.allclose(a.vector, b.vector, rtol=1e-5, atol=1e-6)
    assert len(a.decisions) == len(b.decisions)
    for x, y in zip(a.decisions, b.decisions, strict=True):
        assert x.selected == y.selected
        assert x.weight == pytest.approx(y.weight, rel=1e-5, abs=1e-9)
        assert x.trimmed_share == pytest.approx(y.trimmed_share, rel=1e-5, abs=1e-9)
        assert (x.score is None) == (y.score is None)
        if x.score is not None:
            assert x.score == pytest.approx(y.score, rel=1e-5, abs=1e-9)


def draw(seed: int, n: int, d: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    x[:2] = 4.0 * x[:2] + 3.0  # two outliers
    return x


class Counting:
    """A source that records the shape of every chunk it hands out."""

    def __init__(self, inner: Columns) -> None:
        self.inner = inner
        self.shapes: list[tuple[int, int]] = []
        self.n, self.d, self.dtype = inner.n, inner.d, inner.dtype
        self.device, self.budget = inner.device, inner.budget

    def columns(self, start: int, stop: int, rows: Any = None) -> torch.Tensor:
        chunk = self.inner.columns(start, stop, rows)
        self.shapes.append(tuple(chunk.shape))  # type: ignore[arg-type]
        return chunk


@pytest.mark.parametrize("pre", [None, "nnm"])
@pytest.mark.parametrize("rule", sorted(RULES))
def test_tensor_source_without_budget_is_bit_equal(rule: str, pre: str | None) -> None:
    x = draw(0, 11, 1000)
    a = aggregate(rule, x, f=2, pre=pre, **PARAMS.get(rule, {}))
    b = aggregate(rule, TensorColumns(x), f=2, pre=pre, **PARAMS.get(rule, {}))
    assert torch.equal(a.vector, b.vector)
    assert [astuple(d) for d in a.decisions] == [astuple(d) for d in b.decisions]


@pytest.mark.parametrize("pre", [None, "nnm"])
@pytest.mark.parametrize("rule", sorted(RULES))
@pytest.mark.parametrize("seed", [0, 1])
def test_small_chunks_match_the_tensor(rule: str, pre: str | None, seed: int) -> None:
    x = draw(seed, 11, 301)
    source = Counting(TensorColumns(x, budget=3000))  # 5 to 68 columns per chunk
    params = PARAMS.get(rule, {})
    a = aggregate(rule, x, f=2, pre=pre, **params)
    b = aggregate(rule, source, f=2, pre=pre, **params)
    assert max(width for _, width in source.shapes) < 301  # chunks cut through the data
    if pre is None:
        assert_same(a, b, exact=rule in EXACT)
        return
    # Mixed rows with the same neighbours are exact ties when mixed chunk by chunk, while
    # the in-memory GEMM may split them by a rounding, which moves tie shares: compare
    # the vectors, and the decisions with the rule run on the same mixed rows in memory.
    assert torch.allclose(a.vector, b.vector, rtol=1e-5, atol=1e-6)
    mixed = nnm(TensorColumns(x, budget=3000), f=2).columns(0, 301)
    assert_same(aggregate(rule, mixed, f=2, **params), b, exact=rule in EXACT)


@pytest.mark.parametrize("rule", ["geometric_median", "centered_clipping"])
def test_adaptive_and_weighted_variants_match(rule: str) -> None:
    x = draw(2, 9, 257)
    weights = torch.arange(1.0, 10.0) if rule == "geometric_median" else None
    a = aggregate(rule, x, f=1, weights=weights)
    b = aggregate(rule, TensorColumns(x, budget=2000), f=1, weights=weights)
    assert_same(a, b, exact=False)


# the hand-computed cases of test_rules.py, read one column at a time
CASES: list[tuple[str, torch.Tensor, dict[str, Any]]] = [
    ("krum", col(0, 1, 2, 10, 11), {"f": 1}),
    ("multikrum", col(0, 1, 2, 10, 11), {"f": 1, "m": 2}),
    (
        "trimmed_mean",
        torch.tensor([[1.0, 7.0], [2.0, 5.0], [3.0, 5.0], [100.0, 5.0], [-50.0, 0.0]]),
        {"f": 1},
    ),
    ("trimmed_mean", col(5, 0, 5, 0, 5), {"f": 1}),
    ("median", col(4, 1, 3, 2), {}),
    ("median", col(1, 2, 1, 1), {}),
    (
        "bulyan",
        torch.cat([col(0, 1, 2, 3, 4, 100, 200), -col(0, 1, 2, 3, 4, 100, 200)], dim=1),
        {"f": 1},
    ),
    ("geometric_median", col(0, 1, 10), {"iters": 500, "tol": 0.0}),
    ("fedavg", torch.tensor([[1.0, 2.0], [3.0, 4.0]]), {"weights": torch.tensor([1.0, 3.0])}),
    ("centered_clipping", col(0, 1, 2, 100), {"tau": 1.0, "iters": 3}),
    (
        "median",
        torch.randint(-2, 3, (7, 40), generator=torch.Generator().manual_seed(3)).float(),
        {},
    ),
    (
        "trimmed_mean",
        torch.randint(-2, 3, (7, 40), generator=torch.Generator().manual_seed(4)).float(),
        {"f": 2},
    ),
]


@pytest.mark.parametrize(("rule", "x", "kwargs"), CASES)
def test_conformance_cases_one_column_at_a_time(
    rule: str, x: torch.Tensor, kwargs: dict[str, Any]
) -> None:
    source = Counting(TensorColumns(x, budget=1))  # one column per chunk
    a = aggregate(rule, x, **kwargs)
    b = aggregate(rule, source, **kwargs)
    assert_same(a, b, exact=rule in EXACT)
    assert {width for _, width in source.shapes} == {1}


def test_nnm_and_clipping_of_a_source_are_sources_of_the_same_rows() -> None:
    x = draw(5, 7, 90)
    source = TensorColumns(x, budget=500)
    mixed, clipped = nnm(source, f=2), clip_updates(source, max_norm=2.0)
    assert isinstance(mixed, Columns) and isinstance(clipped, Columns)
    assert torch.allclose(mixed.columns(0, 90), nnm(x, f=2), rtol=1e-6, atol=1e-7)
    assert torch.equal(
        clipped.columns(10, 50, [3, 1]), clip_updates(x, max_norm=2.0)[[3, 1], 10:50]
    )


def test_a_source_is_checked_like_a_tensor() -> None:
    with pytest.raises(ValueError, match="krum with f=1 needs"):
        aggregate("krum", TensorColumns(draw(0, 4, 10), budget=100), f=1)
    with pytest.raises(ValueError, match="floating point"):
        aggregate("median", TensorColumns(torch.ones(3, 4, dtype=torch.int64)))
    assert min_clients("bulyan", 1) == 7


@pytest.mark.parametrize("rule", ["krum", "multikrum", "bulyan", "geometric_median"])
def test_a_multi_pass_rule_reads_a_source_that_fits_once(rule: str) -> None:
    x = draw(6, 11, 400)
    whole = 11 * 400 * 4
    fits = Counting(TensorColumns(x, budget=2 * whole))  # a source that decodes, say
    a = aggregate(rule, x, f=2)
    b = aggregate(rule, fits, f=2)
    assert fits.shapes == [(11, 400)]  # read once, whole
    assert_same(a, b, exact=rule in EXACT)
    tight = Counting(TensorColumns(x, budget=2 * whole - 1))  # the copy would pass half
    assert_same(a, aggregate(rule, tight, f=2), exact=rule in EXACT)
    assert len(tight.shapes) > 1


def test_cached_keeps_sources_in_memory_or_too_large_as_they_are() -> None:
    x = draw(7, 5, 100)
    plain, small = TensorColumns(x), TensorColumns(x, budget=10)
    assert cached(plain) is plain and cached(small) is small
    counting = Counting(TensorColumns(x, budget=5 * 100 * 4 * 2 + 100))
    held = cached(counting)
    assert isinstance(held, TensorColumns) and held.budget == 5 * 100 * 4 + 100
    assert torch.equal(held.columns(10, 20, [4, 0]), x[[4, 0], 10:20])
    assert counting.shapes == [(5, 100)]
    assert cached(Counting(TensorColumns(x, budget=5 * 100 * 4 * 2 - 1))).budget is not None


@pytest.mark.parametrize("rule", sorted(RULES))
def test_rules_give_the_same_numbers_on_one_thread_and_two(rule: str) -> None:
    x = draw(8, 13, 300_001)  # several ranges of the CPU row passes
    params = PARAMS.get(rule, {})
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        a = aggregate(rule, x, f=2, **params)
        torch.set_num_threads(2)
        b = aggregate(rule, x, f=2, **params)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(a.vector, b.vector)
    assert [astuple(d) for d in a.decisions] == [astuple(d) for d in b.decisions]


@pytest.mark.parametrize("rule", ["geometric_median", "centered_clipping", "fedavg"])
def test_half_precision_updates_match_their_float32_values(rule: str) -> None:
    x = draw(9, 7, 70_000).to(torch.bfloat16)
    a = aggregate(rule, x, f=1)
    b = aggregate(rule, x.float(), f=1)
    assert torch.equal(a.vector, b.vector)
    assert [astuple(d) for d in a.decisions] == [astuple(d) for d in b.decisions]


@pytest.mark.parametrize("rule", ["median", "trimmed_mean", "bulyan"])
def test_wide_chunks_are_sorted_in_spans_of_the_sort_budget(rule: str) -> None:
    x = draw(10, 11, 60_001)  # a 2 MiB sort budget holds 23,831 columns of 11 updates
    source = Counting(TensorColumns(x, budget=1 << 30))
    a = aggregate(rule, x, f=2)
    b = aggregate(rule, source, f=2)
    assert max(width for _, width in source.shapes) > 30_000  # read in wide chunks
    assert_same(a, b, exact=True)


def test_chunks_from_a_source_are_whole_multiples_of_1024_columns() -> None:
    x = draw(11, 3, 100_000)
    source = Counting(TensorColumns(x, budget=3 * 4 * 5000))  # 5,000 columns fit
    aggregate("fedavg", source)
    assert {width for _, width in source.shapes} == {4096, 100_000 - 24 * 4096}
