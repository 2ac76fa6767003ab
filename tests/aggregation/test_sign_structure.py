"""Median and trimmed mean of BitDelta payloads selected from their sign bits (`_signs`).

The payloads are built so that values tie often: every group's magnitudes are drawn from a
handful of float16 values (zero among them, through magnitudes that round to a zero
float16 scale, so that -0.0 and +0.0 meet), one tensor has the same scale in every group
of every update, and some columns have the same sign in every update. The rules read from
the payloads must equal, bit for bit, the same rules with the selection switched off (a
sort of the decoded values) and on the decoded values themselves, with the compiled kernels
and without.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
from numpy.typing import NDArray

from zoo_gym.aggregation import Aggregate, _select, _signs, median, trimmed_mean
from zoo_gym.aggregation._select import _COMPILED
from zoo_gym.aggregation.columns import TensorColumns
from zoo_gym.compression import CodecSpec, encode
from zoo_gym.compression.columns import PayloadColumns
from zoo_gym.core.delta import layout_of

MAX = 10**8
BUDGET = 3000  # bytes: chunks of a few columns, cut inside groups and across tensors
SIZES = [37, 300, 129, 64]  # tensors; the last has one scale in every group of every update
PALETTE = [1e-10, 0.125, 0.25, 0.5, 1.0, 3.0]  # 1e-10: a zero float16 scale, signs kept


def payloads(n: int, group: int, seed: int, scale_dtype: str = "float16") -> list[bytes]:
    """n BitDelta envelopes of `SIZES` whose group magnitudes come from `PALETTE`."""
    g = torch.Generator().manual_seed(seed)
    spec = CodecSpec("bitdelta", group, "group", scale_dtype)
    blobs = []
    for _ in range(n):
        delta = {}
        for t, numel in enumerate(SIZES):
            picks = torch.randint(0, len(PALETTE), (-(-numel // group),), generator=g)
            if t == len(SIZES) - 1:
                picks[:] = 3
            magnitude = torch.tensor(PALETTE)[picks].repeat_interleave(group)[:numel]
            sign = torch.where(torch.rand(numel, generator=g) < 0.5, -1.0, 1.0)
            sign[::7], sign[3::11] = 1.0, -1.0  # columns of one sign in every update
            delta[f"t{t}"] = sign * magnitude
        blobs.append(encode(delta, spec))
    return blobs


def source(blobs: list[bytes]) -> PayloadColumns:
    layout = layout_of({f"t{t}": torch.zeros(numel) for t, numel in enumerate(SIZES)})
    return PayloadColumns(blobs, layout, max_elements=MAX, budget=BUDGET)


@pytest.fixture(autouse=True)
def one_thread(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # per-row tie shares are float64 sums in chunk order: one thread fixes that order
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    yield
    _signs.use_sign_structure(True)
    _signs.use_sign_kernel(None)


# NumPy, and each compiled kernel this CPU runs
ENGINES = ["numpy", *getattr(_COMPILED.module, "sign_kernels", ())]


def use_engine(engine: str) -> bool:
    """Select `engine` (see ENGINES); returns the previous `_select.use_compiled` setting."""
    _signs.use_sign_kernel(None if engine == "numpy" else engine)
    return _select.use_compiled(engine != "numpy")


def run(rule: str, updates: object, f: int) -> Aggregate:
    if rule == "median":
        return median(updates)  # type: ignore[arg-type]
    return trimmed_mean(updates, f=f)  # type: ignore[arg-type]


def assert_same(a: Aggregate, b: Aggregate) -> None:
    assert torch.equal(a.vector, b.vector)
    assert [(d.weight, d.selected, d.trimmed_share) for d in a.decisions] == [
        (d.weight, d.selected, d.trimmed_share) for d in b.decisions
    ]


CASES = [
    (n, group, rule, f)
    for n in (5, 6, 50, 101)
    for group in (8, 12, 128)
    for rule, fs in (("median", [0]), ("trimmed", sorted({1, max(1, n // 10)})))
    for f in fs
]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize(("n", "group", "rule", "f"), CASES)
def test_selection_from_signs_equals_the_sort(
    n: int, group: int, rule: str, f: int, engine: str
) -> None:
    blobs = payloads(n, group, seed=n * 1000 + group)
    payload_source = source(blobs)
    decoded = payload_source.columns(0, payload_source.d)
    previous = use_engine(engine)
    try:
        structured = run(rule, payload_source, f)
        _signs.use_sign_structure(False)
        sorted_path = run(rule, payload_source, f)
        in_memory = run(rule, TensorColumns(decoded, budget=BUDGET), f)
        plain = run(rule, decoded, f)
    finally:
        _select.use_compiled(previous)
    assert_same(structured, sorted_path)
    assert_same(structured, in_memory)
    assert torch.equal(structured.vector, plain.vector)  # other chunks: shares differ in ulps


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize(("group", "rule", "f"), [(8, "median", 0), (128, "trimmed", 150)])
def test_many_updates(group: int, rule: str, f: int, engine: str) -> None:
    # 1,500 rows: the radix sort's high byte, places and positions past 1,024, the sort keys
    # formed for a few dozen groups at a time (group 8: 67 groups), and runs of a hundred or
    # more equal scales, several at each cut
    payload_source = source(payloads(1500, group, seed=group))
    previous = use_engine(engine)
    try:
        structured = run(rule, payload_source, f)
        _signs.use_sign_structure(False)
        sorted_path = run(rule, payload_source, f)
    finally:
        _select.use_compiled(previous)
    assert_same(structured, sorted_path)


@pytest.mark.skipif(_COMPILED.module is None, reason="the compiled kernels were not built")
@pytest.mark.parametrize("kernel", getattr(_COMPILED.module, "sign_kernels", ()))
def test_sign_rule_refuses_what_is_not_a_float16_scale(kernel: str) -> None:
    module = _COMPILED.module
    assert module is not None
    n, m = 4, 16
    signs = np.full((n, 2), 0xA5, dtype=np.uint8)
    out, counts = np.empty(m, dtype=np.float32), np.zeros(n, dtype=np.int64)
    codes, table = np.zeros((n, m + 32), dtype=np.uint8), np.empty(4 * m)

    def call(scales: NDArray[np.float32], codes: NDArray[np.uint8] = codes) -> int:
        tied: int = module.sign_rule(
            signs, 0, m, 0, 8, scales, 0, 0, out, counts, codes, table, 0, kernel
        )
        return tied

    good = np.array([[0.5, 0.25], [1.0, 0.0], [-0.0, 3.0], [65504.0, 2.0**-24]], np.float32)
    call(good)  # float16 values, -0.0 and the subnormals among them
    positive = np.unpackbits(signs, axis=1).astype(bool)  # 0xA5: + - + - - + - +
    values = np.where(positive, 1.0, -1.0) * np.repeat(good.astype(np.float64), 8, axis=1)
    assert np.array_equal(out, np.median(values, axis=0).astype(np.float32))
    for bad in (0.1, -0.5, 65536.0, float("inf"), float("nan"), 1.5 * 2.0**-24):
        scales = good.copy()
        scales[2, 1] = bad
        with pytest.raises(ValueError, match="not a float16 value"):
            call(scales)
    with pytest.raises(ValueError, match="codes"):  # no room for the last block's 32 bytes
        call(good, np.zeros((n, m + 31), dtype=np.uint8))


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize(
    ("n", "rule"), [(1, "median"), (2, "median"), (3, "median"), (3, "trimmed")]
)
def test_few_updates(n: int, rule: str, engine: str) -> None:
    # cut positions clipped at both ends: with one update every value is the median
    payload_source = source(payloads(n, 8, seed=n))
    previous = use_engine(engine)
    try:
        structured = run(rule, payload_source, 1)
        _signs.use_sign_structure(False)
        assert_same(structured, run(rule, payload_source, 1))
    finally:
        _select.use_compiled(previous)
    if n == 1:
        assert torch.equal(structured.vector, payload_source.columns(0, payload_source.d)[0] + 0.0)


def test_trimmed_mean_with_f_zero_takes_the_sum() -> None:
    # f = 0 keeps every value: no selection, the plain sum over the rows either way
    blobs = payloads(6, 8, seed=3)
    structured = trimmed_mean(source(blobs), f=0)
    _signs.use_sign_structure(False)
    assert_same(structured, trimmed_mean(source(blobs), f=0))


def test_cut_values_are_the_sorted_values() -> None:
    # the selection on its own, by hand: 3 updates, one group of 8 values, scales 0.5, 0,
    # 0.25; update 0 all positive, update 1 all negative (-0.0), update 2 alternating
    blobs = [
        encode({"w": torch.full((8,), 0.5)}, CodecSpec("bitdelta", 8, "group", "float16")),
        encode({"w": torch.full((8,), -1e-10)}, CodecSpec("bitdelta", 8, "group", "float16")),
        encode(
            {"w": torch.tensor([0.25, -0.25] * 4)}, CodecSpec("bitdelta", 8, "group", "float16")
        ),
    ]
    layout = layout_of({"w": torch.zeros(8)})
    payload_source = PayloadColumns(blobs, layout, max_elements=MAX, budget=BUDGET)
    pieces = payload_source.sign_groups(2, 6)
    assert pieces is not None
    cuts = _signs.cut_values(pieces, 4, [0, 1, 2, 2])
    # columns 2..5: values (0.5, -0.0, 0.25), (0.5, -0.0, -0.25), ...
    expected = np.array(
        [[0.0, -0.25, 0.0, -0.25], [0.25, 0.0, 0.25, 0.0], [0.5] * 4, [0.5] * 4],
        dtype=np.float32,
    )
    assert np.array_equal(cuts, expected)


def test_sign_groups_only_for_float16_scales() -> None:
    # bfloat16 or float32 scales: their sums depend on the order, so the sort's path
    assert source(payloads(5, 8, seed=1, scale_dtype="bfloat16")).sign_groups(0, 10) is None
    assert source(payloads(5, 8, seed=1, scale_dtype="float32")).sign_groups(0, 10) is None
    pieces = source(payloads(5, 8, seed=1)).sign_groups(30, 340)
    assert pieces is not None
    assert [(p.start, p.stop, p.phase) for p in pieces] == [(0, 7, 6), (7, 307, 0), (307, 310, 0)]
    assert pieces[1].scales.shape == (5, 38)
    assert pieces[1].signs.shape == (5, 38)
    assert [p.bit for p in pieces] == [6, 0, 0]  # value 30 of t0; the others from value 0


@pytest.mark.parametrize("rule", ["median", "trimmed"])
def test_bfloat16_scales_take_the_sort(rule: str) -> None:
    blobs = payloads(7, 12, seed=2, scale_dtype="bfloat16")
    payload_source = source(blobs)
    decoded = payload_source.columns(0, payload_source.d)
    assert_same(run(rule, payload_source, 1), run(rule, TensorColumns(decoded, budget=BUDGET), 1))
