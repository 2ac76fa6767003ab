"""Pairwise distances of BitDelta payloads from their sign bits (`_sign_gram`), against
float64 distances of the decoded values, and the rules that read them, against the same
rules on the decoded tensor."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from numpy.typing import NDArray

from zoo_gym.aggregation import _core, _sign_gram, _signs, aggregate
from zoo_gym.aggregation._core import squared_distances
from zoo_gym.compression import CodecSpec, encode
from zoo_gym.compression.columns import PayloadColumns
from zoo_gym.core.delta import layout_of

MAX = 10**8
SHAPES = {"a": (3, 333), "b": (7,), "c": (2, 517), "d": (1,)}  # 2,040 values in 4 tensors
_PASSES = _core._PASSES.module
compiled = pytest.mark.skipif(_PASSES is None, reason="the compiled passes were not built")


def blobs(n: int, group: int, seed: int, common: float = 0.0) -> list[bytes]:
    """n BitDelta envelopes (float16 scales) of random updates plus `common` times one
    shared random update."""
    g = torch.Generator().manual_seed(seed)
    shared = {k: torch.randn(s, generator=g) for k, s in SHAPES.items()}
    spec = CodecSpec("bitdelta", group, "group", "float16")
    return [
        encode(
            {k: torch.randn(s, generator=g) + common * shared[k] for k, s in SHAPES.items()}, spec
        )
        for _ in range(n)
    ]


def source(payloads: list[bytes], budget: int = 10**6) -> PayloadColumns:
    layout = layout_of({k: torch.zeros(s) for k, s in SHAPES.items()})
    return PayloadColumns(payloads, layout, max_elements=MAX, budget=budget)


def reference(x: NDArray[np.float64]) -> NDArray[np.float64]:
    """Squared distances of the rows of x, each a float64 sum of squared differences."""
    return np.square(x[:, None, :] - x[None, :, :]).sum(axis=2)


@compiled
@pytest.mark.parametrize("vector", [True, False])
@pytest.mark.parametrize(("n", "group"), [(2, 8), (9, 1), (13, 12), (37, 128), (6, 200)])
def test_distances_from_signs_equal_those_of_the_values(n: int, group: int, vector: bool) -> None:
    # groups of 1 to 200 values (1 to 4 words), cut by the tensors' ends and by the bytes;
    # 37 rows: blocks of 4 pairs and the pairs after them
    payloads = source(blobs(n, group, seed=n + group))
    x = payloads.columns(0, payloads.d).double().numpy()
    pieces = payloads.sign_groups(0, payloads.d)
    assert pieces is not None
    words, values, sizes = packed = _sign_gram.empty(pieces, n)
    _sign_gram.fill(_PASSES, pieces, packed, (0, n))
    assert sizes.sum() == payloads.d
    dist = np.zeros((n, n))
    _PASSES.sign_distances(words, values, sizes, dist, 0, 1, vector)
    expected = np.tril(reference(x), -1)
    assert np.allclose(dist, expected, rtol=1e-13, atol=0.0)
    for lanes in (2, 3, 5):  # the rows dealt out to threads: the same bits
        split = np.zeros((n, n))
        for t in range(lanes):
            _PASSES.sign_distances(words, values, sizes, split, t, lanes, vector)
        assert np.array_equal(split, dist)


@compiled
def test_a_shared_component_cancels_nothing() -> None:
    # two updates that share a large component: every value 60,000 or 60,032 in size (one
    # float16 step apart), with the same signs, so each value adds 32^2 exactly; unshifted,
    # G_ii + G_jj - 2 G_ij would subtract numbers 3,500 times the distance
    spec = CodecSpec("bitdelta", 8, "group", "float16")
    signs = torch.where(torch.arange(64) % 3 == 0, -1.0, 1.0)
    payloads = [encode({"w": signs * 60000.0}, spec), encode({"w": signs * 60032.0}, spec)]
    layout = layout_of({"w": torch.zeros(64)})
    dist = squared_distances(PayloadColumns(payloads, layout, max_elements=MAX, budget=10**6))
    assert dist.tolist() == [[0.0, 65536.0], [65536.0, 0.0]]


@compiled
@pytest.mark.parametrize("extra", [None, "origin"])
def test_squared_distances_from_payloads(extra: str | None) -> None:
    # several chunks (a small budget), two threads, against the decoded values; with the
    # origin as an extra row, each update's squared length
    payloads = source(blobs(11, 16, seed=5, common=3.0), budget=2000)
    x = payloads.columns(0, payloads.d).double().numpy()
    if extra is not None:
        x = np.concatenate([x, np.zeros((1, x.shape[1]))])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = squared_distances(payloads, extra)
        torch.set_num_threads(1)
        one = squared_distances(payloads, extra)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)  # the threads do not change a bit
    assert np.allclose(two.numpy(), reference(x), rtol=1e-13, atol=0.0)
    assert torch.equal(two, two.T)


@compiled
@pytest.mark.parametrize(
    "rule", ["krum", "multikrum", "bulyan", "geometric_median", "centered_clipping"]
)
def test_rules_from_payloads_choose_as_on_the_tensor(rule: str) -> None:
    # centered clipping from the origin: the origin's distances come from the signs too
    payloads = source(blobs(15, 32, seed=7, common=2.0), budget=4000)
    assert _core._sign_source(payloads) is not None  # the rules read the sign bits
    x = payloads.columns(0, payloads.d)
    params: dict[str, float] = {"f": 2}
    if rule == "centered_clipping":
        params["tau"] = 30.0
    from_payloads = aggregate(rule, payloads, **params)
    _signs.use_sign_structure(False)
    try:
        from_gram = aggregate(rule, payloads, **params)
    finally:
        _signs.use_sign_structure(True)
    on_tensor = aggregate(rule, x, **params)
    for other in (from_gram, on_tensor):
        assert [d.selected for d in from_payloads.decisions] == [
            d.selected for d in other.decisions
        ]
        assert torch.allclose(from_payloads.vector, other.vector, rtol=1e-6, atol=1e-7)


@compiled
@pytest.mark.parametrize("vector", [True, False])
@pytest.mark.parametrize("group", [1, 8, 12, 128])
def test_sums_from_signs_are_the_decoded_rows_sums(group: int, vector: bool) -> None:
    # equal weights: every float16 value sums exactly, so the plain float64 sum's bits; other
    # weights: one fused multiply-add per row in order, as `_passes.row_sum` on the values
    payloads = source(blobs(6, group, seed=group, common=1.0))
    x = payloads.columns(0, payloads.d).numpy()
    rows = np.array([4, 0, 5, 2], dtype=np.int64)
    weights = np.array([0.1, 0.7, 1e-3, 0.25])
    pieces = payloads.sign_groups(0, payloads.d)
    assert pieces is not None
    plain, weighted = np.empty(payloads.d), np.empty(payloads.d)
    for p in pieces:
        args = (p.signs.numpy(), p.bit, p.stop - p.start, p.phase, p.group, p.scales.numpy())
        _PASSES.sign_sum(*args, rows, None, plain[p.start : p.stop], vector)
        _PASSES.sign_sum(*args, rows, weights, weighted[p.start : p.stop], vector)
    assert np.array_equal(plain, x[rows].astype(np.float64).sum(axis=0))
    expected = np.empty(payloads.d, dtype=np.float32)
    _PASSES.row_sum(x, "f", rows, weights, 1.0, expected)
    assert np.array_equal(weighted.astype(np.float32), expected)


@compiled
def test_mean_of_rows_from_payloads_keeps_the_bits() -> None:
    # the sum path against the decoding one, and one row's copy keeps a -0.0 (a zero scale
    # with a clear sign bit), which a sum from +0.0 would turn into +0.0
    spec = CodecSpec("bitdelta", 8, "group", "float16")
    values = [torch.tensor([-1e-10] * 8 + [0.5, -0.25] * 4), torch.randn(16), torch.randn(16)]
    layout = layout_of({"w": torch.zeros(16)})
    payloads = PayloadColumns(
        [encode({"w": v}, spec) for v in values], layout, max_elements=MAX, budget=10**6
    )
    x = payloads.columns(0, 16)
    assert _core._sign_source(payloads) is not None  # the sums come from the sign bits
    for rows in ([0], [2, 0], [0, 1, 2]):
        got = _core.mean_of_rows(payloads, rows)
        _signs.use_sign_structure(False)
        try:
            decoded = _core.mean_of_rows(payloads, rows)
        finally:
            _signs.use_sign_structure(True)
        assert torch.equal(got.view(torch.int32), decoded.view(torch.int32))
    assert torch.equal(_core.mean_of_rows(payloads, [0])[:8], x[0, :8])
    assert str(float(x[0, 0])) == "-0.0"
