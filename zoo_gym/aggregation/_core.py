"""Shared pieces of the aggregation rules: result types, checks and chunked kernels.

Every rule takes the updates as one `(n, d)` tensor of deltas (any floating dtype, any
device) or as a column source (`columns.Columns`), and returns an `Aggregate`: the `(d,)`
float32 aggregate plus one `Decision` per update, in input order. The kernels read the
updates only as column chunks `(n, c)`. For a tensor the width comes from a byte budget (1%
of the input, between 1 MiB and 32 MiB), so that the extra memory of a rule is the `(d,)`
output plus a few percent of the input, never an `(n, d)` copy; for a source with a
`budget`, from that budget. Sums and
accumulators are float64; per-chunk products and selections run in the working dtype
(float32, or float64 when the updates are float64). On CPU the passes share their column
ranges among `torch.get_num_threads()` threads (`run_threaded`, or `run_workers` with
torch set to one thread in each), each running its kernels on its own, so that no kernel
waits on a barrier of all threads.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import ModuleType
from typing import Literal, TypeVar

import numpy as np
import torch
from numpy.typing import NDArray
from torch import Tensor

from zoo_gym.core.extension import Extension

from . import _sign_gram, _signs, columns
from .columns import Columns, SignGroups, TensorColumns, Updates

__all__ = ["Aggregate", "Decision"]

_T = TypeVar("_T")
_I = TypeVar("_I")

_MIN_BUDGET = 1 << 20  # bytes of chunk temporaries, at least
_MAX_BUDGET = 32 << 20  # and at most
_SORT_BUDGET = 2 << 20  # at most, for rules that sort chunks on CPU: a chunk stays in L2
_BUDGET_SHARE = 100  # 1% of the input
# bytes of a chunk read from a source with a budget on the CPU, at most: glibc maps larger
# allocations afresh each time, and faulting in fresh pages costs more than decoding them
# (about 7 ns per value for 400 MiB chunks of n = 1000 BitDelta rows against 2.5 ns for
# 32 MiB). A GPU's caching allocator reuses its blocks, so there a chunk takes the budget:
# with chunks of 32 MiB (2,686 at n = 1,000, d = 22M) Multi-Krum took 27 s on an H200
_SOURCE_CHUNK = 32 << 20
_SOURCE_ALIGN = 1024  # columns; wider chunks from a source are a multiple of it
# bytes per value that decoding a chunk on a GPU holds beside it (the sign bytes of its rows
# as int32 indices into the sign table, 0.5; a subset's signs picked, 0.125; its scales)
_DECODE_BYTES_ACCELERATOR = 1
# columns per float64 accumulator span on CPU (512 KiB, in L2): each row's kernel over it
# (about 25 us) outlasts the Python work around it, so threads do not queue for Python's
# lock (over 32,000 columns two threads summed 45 rows of 10M no faster than one)
_SUM_WIDTH = 1 << 16
# bytes of the float64 copy of a span of the rows that a weighted sum on a GPU adds up,
# beside the chunk (a sum over the whole chunk in float64 copied all of it: Multi-Krum's
# mean of 900 rows peaked at 4.4 GiB above the payloads with a budget of 2 GiB)
_SUM_SPAN_ACCELERATOR = 256 << 20
_GRAM_BLOCK = 32  # columns per block of the block-triangular Gram product on CPU
# On a GPU the Gram product of a chunk is one batched GEMM over up to `_GRAM_SLICES` slices
# of its columns, each at least `_GRAM_SLICE_MIN` wide, whose (slices, n, n) float32
# products take at most `_GRAM_SLICE_BYTES`: a single (n, n) product over a chunk of
# 100,000s of columns has too few output tiles to occupy the chip's multiprocessors
_GRAM_SLICES = 16
_GRAM_SLICE_MIN = 4096
_GRAM_SLICE_BYTES = 256 << 20
# bytes of the shifted block of columns of the Gram product on CPU, at most: it stays in
# cache while it is multiplied (n = 50: 6,144 columns, 1.2 MiB; n = 1000: 1,280 columns)
_GRAM_SCRATCH = 5 << 20
_GRAM_SCRATCH_COLUMNS = (1024, 6144)  # columns of that block, at least and at most
_GRAM_ALIGN = 256  # the block's width is a multiple of it
_GRAM_PAD = 16  # values of padding per row of the block
# chunk sequences of the Gram product on CPU, each with its own partial matrix, whatever the
# thread count (so the result does not depend on it): at most this many threads share it
_GRAM_LANES = 4
# updates up to which iterative rules run on the pairwise distances (one pass for them, one
# for the result) instead of a pass per step: above, the (n, n) float64 matrices cost more
GRAM_STEPS_LIMIT = 2048
Extra = Tensor | Literal["origin"] | None  # a point to add to the Gram matrix as a last row
_PROBE_WIDTH = 4096  # columns of the first chunk used to choose the first reference
# rows of the Gram matrix up to which the compiled product (`_passes.gram`) runs instead of
# the GEMM: below it the GEMM's lower block triangle multiplies up to 1.5x the pairs and the
# shift does not overlap the products (2 threads: 1.9-2.4x faster at n = 50, 1.3-1.5x at 100
# and 150, slower from 200: at n = 1,000 the GEMM's 49 GFMA/s a core against 28)
_COMPILED_GRAM_ROWS = 160

_PASSES = Extension("zoo_gym.aggregation._passes")
_SIGN_SUM_BYTES = 32 << 20  # sign bytes of all rows that one range of `_sign_sum` reads
_SIGN_SUM_COLUMNS = 1 << 18  # and at most these columns: its float64 sums take 2 MiB


def use_compiled_passes(enabled: bool) -> bool:
    """Run the CPU sums of rows and small Gram products through the compiled kernels
    (`zoo_gym/aggregation/_passes.c`) when `enabled` and built, through NumPy and the GEMM
    otherwise (the plain sums give the same bits, the rest agrees to rounding). Returns the
    previous setting."""
    return _PASSES.use(enabled)


@dataclass(frozen=True)
class Decision:
    """What a rule did with one update.

    `selected`: the update contributed to the aggregate at all. `weight`: its mean weight in
    the aggregate over coordinates (weights of all updates sum to 1 for averaging rules).
    `trimmed_share`: share of coordinates in which it was left out (for clipping rules, the
    share of its length removed by clipping). `score`: the rule's score where it has one
    (Krum score, distance to the centre). `reason`: one short sentence for the ledger.
    """

    selected: bool
    weight: float
    trimmed_share: float
    score: float | None
    reason: str


@dataclass(frozen=True)
class Aggregate:
    """The aggregate `(d,)` float32 and one decision per update, in input order."""

    vector: Tensor  # (d,) float32
    decisions: tuple[Decision, ...]


def check_updates(updates: Updates, rule: str) -> tuple[int, int]:
    """Return `(n, d)` of a floating `(n, d)` tensor or column source with n >= 1, or raise
    ValueError."""
    source = as_columns(updates, rule)
    return source.n, source.d


def as_columns(updates: Updates, rule: str) -> Columns:
    """The updates as a column source (a tensor as `TensorColumns` at the default widths),
    checked: floating point, n >= 1 and d >= 1; ValueError otherwise."""
    if isinstance(updates, Tensor):
        if updates.dim() != 2:
            raise ValueError(
                f"{rule}: updates must be one (n, d) tensor, got shape {tuple(updates.shape)}; "
                "flatten each update and stack them"
            )
        source: Columns = TensorColumns(updates)
    elif isinstance(updates, Columns):
        source = updates
    else:
        raise ValueError(
            f"{rule}: updates must be an (n, d) tensor or a column source, "
            f"got {type(updates).__name__}"
        )
    if not source.dtype.is_floating_point:
        raise ValueError(f"{rule}: updates must be floating point, got {source.dtype}")
    if source.n < 1 or source.d < 1:
        raise ValueError(f"{rule}: need at least one update of at least one coordinate")
    return source


def check_f(f: int, rule: str) -> None:
    """Raise ValueError unless `f` is a non-negative int."""
    if isinstance(f, bool) or not isinstance(f, int) or f < 0:
        raise ValueError(f"{rule}: f (number of Byzantine updates) must be an int >= 0, got {f!r}")


def check_count(value: object, name: str, rule: str, minimum: int = 1) -> int:
    """`value` as an int >= minimum (a whole float such as 5.0 from a config is accepted),
    or ValueError."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{rule}: {name} must be an int >= {minimum}, got {value!r}")
    return value


def require(n: int, minimum: int, rule: str, condition: str) -> None:
    """Raise ValueError unless `n >= minimum`, naming the precondition."""
    if n < minimum:
        raise ValueError(
            f"{rule} needs {condition} (at least {minimum} updates), got {n}; "
            "collect more updates or lower f"
        )


def check_weights(weights: Tensor | None, n: int, rule: str) -> Tensor:
    """Return weights as a `(n,)` float64 CPU tensor normalised to sum 1 (uniform if None)."""
    if weights is None:
        return torch.full((n,), 1.0 / n, dtype=torch.float64)
    w = torch.as_tensor(weights).detach().to("cpu", torch.float64).reshape(-1)
    if w.numel() != n:
        raise ValueError(f"{rule}: got {w.numel()} weights for {n} updates; pass one per update")
    if not bool(torch.isfinite(w).all()) or bool((w < 0).any()):
        raise ValueError(f"{rule}: weights must be finite and >= 0")
    total = float(w.sum())
    if total <= 0.0:
        raise ValueError(f"{rule}: weights sum to zero; give at least one update a positive weight")
    return w / total


def work_dtype(updates: Updates) -> torch.dtype:
    """float64 for float64 updates, float32 for every other floating dtype."""
    return torch.float64 if updates.dtype == torch.float64 else torch.float32


def chunk_width(
    source: Columns, bytes_per_value: int, max_budget: int = _MAX_BUDGET, parallel: int = 1
) -> int:
    """Columns per chunk so that chunk temporaries of `bytes_per_value` bytes per value of an
    `(n, width)` chunk stay within the budget.

    A source without a budget (the in-memory tensor): 1% of the input, clamped to [1 MiB,
    `max_budget`] (32 MiB by default). A source with one: its budget shared among
    `parallel` chunks at a time, each also holding the chunk the source returns (and, off
    the CPU, what decoding it takes), and that chunk (on the CPU) at most 32 MiB and, when
    wider than 1024 columns, a multiple of 1024 (so that ranges decoded from packed payloads
    start on whole bytes and groups).
    """
    n, d = source.n, source.d
    itemsize = torch.finfo(source.dtype).bits // 8
    if source.budget is not None:
        decoding = 0 if source.device.type == "cpu" else _DECODE_BYTES_ACCELERATOR
        per_column = n * (bytes_per_value + itemsize + decoding) * max(1, parallel)
        width = source.budget // per_column
        if source.device.type == "cpu":
            width = min(width, _SOURCE_CHUNK // (n * itemsize))
        if width > _SOURCE_ALIGN:  # whole bytes and groups of a decoded range
            width -= width % _SOURCE_ALIGN
        return max(1, min(d, width))
    input_bytes = n * d * itemsize
    budget = min(max(input_bytes // _BUDGET_SHARE, _MIN_BUDGET), max(_MIN_BUDGET, max_budget))
    return max(1, min(d, budget // max(1, n * bytes_per_value)))


def sort_budget(updates: Updates) -> int:
    """Largest chunk budget for rules that sort chunks: 2 MiB on CPU, where a chunk should
    stay in the L2 cache while it is sorted and scanned; 32 MiB elsewhere."""
    return _SORT_BUDGET if updates.device.type == "cpu" else _MAX_BUDGET


def spans(d: int, width: int) -> Iterator[tuple[int, int]]:
    """`(start, stop)` column ranges of at most `width` columns covering `range(d)`."""
    for start in range(0, d, width):
        yield start, min(d, start + width)


def chunks(
    source: Columns, width: int, rows: Sequence[int] | None = None
) -> Iterator[tuple[int, int, Tensor]]:
    """`(start, stop, chunk)` for column ranges of at most `width` columns, chunk `(n, c)`
    (or `(len(rows), c)`) read from the source; one pass over the updates."""
    for start, stop in spans(source.d, width):
        yield start, stop, source.columns(start, stop, rows)


def column_chunks(updates: Updates, bytes_per_value: int) -> Iterator[tuple[int, int]]:
    """Column ranges for chunks of `bytes_per_value` bytes per value (see `chunk_width`)."""
    source = as_columns(updates, "column_chunks")
    return spans(source.d, chunk_width(source, bytes_per_value))


def gram(updates: Updates, extra: Extra = None) -> Tensor:
    """Shifted Gram matrix `(n, n)` float64 of the updates, for pairwise distances; one
    pass over the column chunks. With `extra` (a `(d,)` point, or "origin" for zeros) it is
    `(n + 1, n + 1)`, the point as row n: shifted and multiplied with each block of the
    updates, without a copy of them.

    G = sum over column chunks C of (X_C - 1 r_C^T)(X_C - 1 r_C^T)^T, each chunk's product
    in the working dtype, accumulated into float64. Only the distances
    ||x_i - x_j||^2 = G_ii + G_jj - 2 G_ij are meaningful: they do not depend on the shifts
    r_C, so each chunk may use its own reference row. The reference is the medoid of the
    distances accumulated so far (the update with the smallest sum of distances to the
    others; for the first chunk, of the distances over its first 4096 columns), re-chosen
    before chunks 1, 2, 4, 8, ...: a central update rather than a far outlier, so the
    shifted values stay small and G_ii + G_jj - 2 G_ij does not cancel even when all
    updates share a large common component (full weights instead of deltas). x_i - x_r is
    exact when the two are within a factor 2 (Sterbenz), and small integer inputs give
    exact distances.

    On CPU, up to `_COMPILED_GRAM_ROWS` rows with AVX-512, the compiled kernel
    (`_passes.gram`, see `zoo_gym/aggregation/_passes.c`) shifts and multiplies each chunk
    in blocks of at most 1,024 columns that stay in L2, on 4 x 4 tiles of the lower triangle
    (58% of the products of the whole matrix for n = 50), float32 sums of at most 64
    products per lane added into float64 per block. Otherwise a chunk (columns of about 1% of
    the input) is shifted a block of columns at a
    time into a scratch of a few MiB that stays in cache, and each block is multiplied at
    once into the chunk's working-dtype product (`_shifted_product`); only the lower block
    triangle is multiplied, in column blocks of 32 (76% of the flops of the whole product
    for n = 50, 52% for n = 1000). The chunks are dealt out to `_GRAM_LANES` lanes in turn
    (chunk k to lane k mod L), each accumulating its own Gram matrix with its own
    references; up to `torch.get_num_threads()` threads run the lanes, with torch (and the
    GEMM under it) on one thread each (`run_workers`). The lanes' matrices are added in
    lane order, and the chunk widths do not depend on the threads either, so the result
    depends neither on the thread count nor on timing (a coordinator's aggregate does not
    change with its cores). On a GPU each
    chunk (the source's budget) is shifted whole and its whole product formed at once, as
    one batched GEMM over slices of its columns (`_product`); the GEMM follows torch's
    float32 matmul precision: keep it at "highest" (the default), TF32 keeps 10 bits.
    """
    source = as_columns(updates, "gram")
    n, dtype, device = source.n, work_dtype(source), source.device
    lanes = _GRAM_LANES if device.type == "cpu" else 1
    width = chunk_width(source, torch.finfo(dtype).bits // 8, parallel=lanes)
    point = extra.detach().to(device, dtype) if isinstance(extra, Tensor) else extra
    plan = _gram_plan(n + (extra is not None), dtype, device, width)
    ranges = list(spans(source.d, width))
    groups = [ranges[t::lanes] for t in range(min(lanes, len(ranges)))]
    threads = min(torch.get_num_threads(), len(groups)) if device.type == "cpu" else 1
    parts = run_workers(lambda group: _gram_part(source, group, plan, point), groups, threads)
    g = parts[0]
    for part in parts[1:]:
        g += part
    return _symmetric(g)


@dataclass(frozen=True)
class _GramPlan:
    """How `_gram_part` multiplies: `width` columns shifted at a time, and the product's
    `blocks` `(i0, i1)`, rows i0: times columns i0:i1 (one block `(0, n)`: the whole
    product)."""

    width: int
    blocks: tuple[tuple[int, int], ...]


def _gram_plan(n: int, dtype: torch.dtype, device: torch.device, width: int) -> _GramPlan:
    """The blocks and scratch width of the shifted products for n updates in chunks of
    `width` columns (see `gram`)."""
    if device.type != "cpu":  # the whole product at once (`_product`)
        return _GramPlan(width, ((0, n),))
    cuts = list(range(0, n, _GRAM_BLOCK))
    if n - cuts[-1] > _GRAM_BLOCK // 2:  # a narrow last block multiplies slowly
        cuts.append(cuts[-1] + _GRAM_BLOCK // 2)
    blocks = tuple(zip(cuts, [*cuts[1:], n], strict=True)) if n > _GRAM_BLOCK // 2 else ((0, n),)
    itemsize = torch.finfo(dtype).bits // 8
    columns = _GRAM_SCRATCH // (n * itemsize) // _GRAM_ALIGN * _GRAM_ALIGN
    columns = min(max(columns, _GRAM_SCRATCH_COLUMNS[0]), _GRAM_SCRATCH_COLUMNS[1])
    return _GramPlan(min(width, columns), blocks)


def _gram_part(
    source: Columns, ranges: list[tuple[int, int]], plan: _GramPlan, extra: Extra
) -> Tensor:
    """The shifted Gram matrix `(m, m)` float64 of the column `ranges` of the source (only
    the lower block triangle of `plan.blocks`; m = n, or n + 1 with the `extra` row), each
    range shifted by the medoid of the updates' distances accumulated so far (see `gram`)."""
    n, dtype, device = source.n, work_dtype(source), source.device
    m = n + (extra is not None)
    g = torch.zeros((m, m), dtype=torch.float64, device=device)
    part = torch.zeros((m, m), dtype=dtype, device=device)  # one range's product
    # the shifted block, rows padded so that their stride is no power of two (a power of
    # two maps the rows onto the same cache sets: 29 against 43 GFMA/s for n = 50)
    scratch = torch.empty((m, plan.width + _GRAM_PAD), dtype=dtype, device=device)
    scratch = scratch[:, : plan.width]
    ref = -1
    for k, (start, stop) in enumerate(ranges):
        chunk = source.columns(start, stop)  # (n, c)
        point = extra[start:stop] if isinstance(extra, Tensor) else extra
        given = _compiled_gram(chunk, m)
        if given is not None:
            del chunk
            ref = _gram_compiled(given, k, ref, point, g)
            continue
        if k == 0:  # probe a few columns, shifted by update 0, for the first medoid
            probe = point[:_PROBE_WIDTH] if isinstance(point, Tensor) else point
            _shifted_product(chunk[:, :_PROBE_WIDTH], 0, scratch, part, plan.blocks, probe)
            ref = _medoid(part.to(torch.float64)[:n, :n])
        elif k & (k - 1) == 0:  # k a power of two
            ref = _medoid(g[:n, :n])
        _shifted_product(chunk, ref, scratch, part, plan.blocks, point)
        del chunk  # before the next is decoded: on a GPU a chunk is most of the budget
        for i0, i1 in plan.blocks:  # only the blocks computed
            g[i0:, i0:i1] += part[i0:, i0:i1]
    return g


# what `_passes` reads, by dtype: its code and the array of the same bits NumPy can hold
_KINDS = {
    torch.float32: ("f", torch.float32),
    torch.float64: ("d", torch.float64),
    torch.float16: ("e", torch.float16),
    torch.bfloat16: ("b", torch.int16),
}


def _compiled_input(chunk: Tensor, kinds: str) -> tuple[str, NDArray[np.generic]] | None:
    """The `_passes` kind and array of a CPU chunk with contiguous rows whose dtype is one of
    `kinds`, when the kernels are built and in use; None otherwise."""
    kind = _KINDS.get(chunk.dtype)
    if (
        not _PASSES.enabled
        or kind is None
        or kind[0] not in kinds
        or chunk.device.type != "cpu"
        or chunk.stride(1) != 1
    ):
        return None
    return kind[0], chunk.detach().view(kind[1]).numpy()


def _compiled_gram(chunk: Tensor, m: int) -> tuple[str, NDArray[np.generic]] | None:
    """The chunk's `_passes` kind and array where `_passes.gram` multiplies it: built, in
    use, AVX-512, a float32, float16 or bfloat16 CPU chunk with contiguous rows and at most
    `_COMPILED_GRAM_ROWS` rows in the product; None otherwise."""
    module = _PASSES.module
    if module is None or not module.GRAM or m > _COMPILED_GRAM_ROWS:
        return None
    return _compiled_input(chunk, "feb")


def _gram_compiled(
    given: tuple[str, NDArray[np.generic]], k: int, ref: int, point: Extra, g: Tensor
) -> int:
    """Chunk k's shifted product (`given` by `_compiled_gram`) added into g's lower
    triangle by `_passes.gram`, the reference chosen as `_gram_part` chooses it; returns
    the reference used."""
    module = _PASSES.module
    assert module is not None
    kind, x = given
    n = x.shape[0]
    extra = point.detach().numpy() if isinstance(point, Tensor) else point
    if k == 0:  # probe a few columns, shifted by update 0, for the first medoid
        probe = np.zeros(g.shape, dtype=np.float64)
        p = extra[:_PROBE_WIDTH] if isinstance(extra, np.ndarray) else extra
        module.gram(x[:, :_PROBE_WIDTH], kind, 0, p, probe)
        ref = _medoid(torch.from_numpy(probe)[:n, :n])
    elif k & (k - 1) == 0:  # k a power of two
        ref = _medoid(g[:n, :n])
    module.gram(x, kind, ref, extra, g.numpy())
    return ref


def _shifted_product(
    chunk: Tensor,
    ref: int,
    scratch: Tensor,
    part: Tensor,
    blocks: Sequence[tuple[int, int]],
    extra: Extra = None,
) -> None:
    """part <- (chunk - chunk[ref]) (chunk - chunk[ref])^T in the blocks `(i0, i1)` (rows
    i0: times columns i0:i1 of `part`), shifting `scratch.shape[1]` columns at a time into
    `scratch` `(n, w)` (`(n + 1, w)` with the `extra` row, the chunk's columns of a point or
    "origin") and adding each block of columns' product into `part` before the next is
    shifted (it is still in cache)."""
    n, c, w = chunk.shape[0], chunk.shape[1], scratch.shape[1]
    outs = [part[i0:, i0:i1] for i0, i1 in blocks]  # (n - i0, i1 - i0)
    whole = [(scratch[i0:], scratch[i0:i1].T) for i0, i1 in blocks]
    for s0 in range(0, c, w):
        x = scratch if c - s0 >= w else scratch[:, : c - s0]  # (m, w)
        block = chunk[:, s0 : s0 + x.shape[1]]
        if block.dtype == x.dtype:
            torch.sub(block, block[ref], out=x[:n])
        else:
            x[:n].copy_(block)
            x[:n].sub_(x[ref].clone())
        if extra is not None:
            r = block[ref].to(x.dtype)
            if isinstance(extra, Tensor):
                torch.sub(extra[s0 : s0 + x.shape[1]], r, out=x[n])
            else:  # the origin
                torch.neg(r, out=x[n])
        operands = whole if x is scratch else [(x[i0:], x[i0:i1].T) for i0, i1 in blocks]
        for out, (a, b) in zip(outs, operands, strict=True):
            _product(a, b, out, s0 > 0)


def _product(a: Tensor, b: Tensor, out: Tensor, add: bool) -> None:
    """out <- a @ b, or out += a @ b when `add`: on the CPU one GEMM; elsewhere the inner
    dimension cut into slices multiplied in one batched GEMM and their products summed in
    the working dtype (see `_GRAM_SLICES`)."""
    slices = 1 if a.device.type == "cpu" else _slices(a.shape[0], a.shape[1], b.shape[1])
    _sliced_product(a, b, out, add, slices)


def _slices(m: int, k: int, n: int) -> int:
    """Slices of the inner dimension k of an (m, k) x (k, n) product off the CPU."""
    return min(_GRAM_SLICES, k // _GRAM_SLICE_MIN, _GRAM_SLICE_BYTES // (4 * m * n))


def _sliced_product(a: Tensor, b: Tensor, out: Tensor, add: bool, slices: int) -> None:
    """`_product` with the inner dimension cut into `slices` slices (one GEMM below 2)."""
    k = a.shape[1]
    if slices < 2:
        if add:
            torch.addmm(out, a, b, out=out)
        else:
            torch.mm(a, b, out=out)
        return
    step = k // slices
    cut = slices * step
    products = torch.bmm(
        a[:, :cut].view(a.shape[0], slices, step).transpose(0, 1),  # (slices, m, step) views
        b[:cut].view(slices, step, b.shape[1]),
    )
    if cut < k:  # the last columns into the first slice's product
        products[0].addmm_(a[:, cut:], b[cut:])
    if add:
        out.add_(products.sum(0))
    else:
        torch.sum(products, 0, out=out)


def _symmetric(g: Tensor) -> Tensor:
    """The exactly symmetric matrix, in place, from one whose lower triangle is exact (the
    rest is not read)."""
    g.tril_()
    return g.add_(torch.tril(g, -1).T)


def _medoid(g: Tensor) -> int:
    """Index of the row with the smallest sum of Euclidean distances, from a Gram matrix
    whose lower triangle is exact (the rest is not read): each row's sum is that of its
    row and its column of the lower triangle of distances; one `(n, n)` temporary."""
    sq = g.diagonal()
    dist = sq[:, None] + sq[None, :]
    dist.sub_(g, alpha=2.0).clamp_min_(0.0).sqrt_().tril_()
    return int((dist.sum(0) + dist.sum(1)).argmin())


def squared_distances(updates: Updates, extra: Extra = None) -> Tensor:
    """Pairwise squared Euclidean distances `(n, n)` float64 from one Gram matrix:
    ||x_i - x_j||^2 = G_ii + G_jj - 2 G_ij, symmetric, zero diagonal, clamped at 0. With
    `extra` (a `(d,)` point or "origin"), `(n + 1, n + 1)` with the point as row n.

    Exactly symmetric: G is, G_ii + G_jj is, and 2 G_ij is exact.

    A source of BitDelta payloads with float16 scales (offering `sign_groups`, on the CPU,
    the compiled passes built) gives its distances from its sign bits instead, without a
    Gram matrix or a decoded value (`_sign_gram`), with `extra` None or "origin"."""
    signed = _sign_distances(as_columns(updates, "squared_distances"), extra)
    if signed is not None:
        return signed
    g = gram(updates, extra)
    sq = g.diagonal()
    dist = sq[:, None] + sq[None, :]
    dist.sub_(g, alpha=2.0).clamp_min_(0.0)
    dist.fill_diagonal_(0.0)
    return dist


def _sign_source(source: Columns) -> SignGroups | None:
    """`source` where `squared_distances` reads its sign bits: BitDelta payloads with
    float16 scales on the CPU, the compiled passes built; None otherwise."""
    signs = _signs.usable(source) if _PASSES.enabled else None
    if signs is None or signs.sign_groups(0, min(source.d, 1)) is None:
        return None
    return signs


def reads_sign_bits(n: int) -> bool:
    """Whether the rules read n updates of a CPU source offering `sign_groups` (BitDelta
    payloads with float16 scales) from their sign bits and scales: distances, sums and order
    statistics without decoding a value. Then a rule over such a source is faster than
    decoding the updates first and running it on the tensor (n = 50, d = 10M, every rule but
    Bulyan: 0.14 to 0.18 s against 1 to 2 s of decoding and 0.2 to 0.6 s of rule). True
    where the compiled passes are built and in use, the sign-bit paths on and n at most
    `_signs.MAX_ROWS`."""
    return _PASSES.enabled and _signs.is_enabled() and n <= _signs.MAX_ROWS


def cached(source: Columns) -> Columns:
    """A source for a rule that reads its updates more than once (`columns.cached`), but
    one whose distances come from its sign bits as it is: the rule then decodes its values
    once, in its last pass."""
    return source if _sign_source(source) is not None else columns.cached(source)


def _sign_distances(source: Columns, extra: Extra) -> Tensor | None:
    """`squared_distances` of a source of BitDelta payloads from their sign bits (see
    `_sign_gram`), or None where it does not offer them or `extra` is a point. The pairs of
    rows (2q, 2q + 1) of each chunk are dealt out to `torch.get_num_threads()` threads (q
    to thread q mod T); how a pair's sum is formed does not depend on them, so neither does
    the result."""
    module = _PASSES.module if _PASSES.enabled else None
    signs = _sign_source(source) if isinstance(extra, str | None) else None
    if module is None or signs is None:
        return None
    first = signs.sign_groups(0, min(source.d, 1))
    assert first is not None  # `_sign_source` asked the same
    n = source.n
    lanes = min(torch.get_num_threads(), (n + 1) // 2)
    dist, norms = np.zeros((n, n)), np.zeros(n)
    bounds = [(n * t // lanes, n * (t + 1) // lanes) for t in range(lanes)]
    packed: _sign_gram.Packed | None = None
    width = _sign_gram.chunk_width(n, first[0].group, source.budget)
    with ThreadPoolExecutor(lanes) as pool:  # one for all chunks: threads start slowly
        for start, stop in spans(source.d, width):
            pieces = signs.sign_groups(start, stop)
            assert pieces is not None
            packed = _sign_gram.empty(pieces, n, packed)
            list(pool.map(functools.partial(_sign_gram.fill, module, pieces, packed), bounds))
            list(pool.map(functools.partial(_sign_lane, module, packed, dist, lanes), range(lanes)))
            if extra == "origin":
                norms += np.einsum("bij,bj->i", np.square(packed[1]), packed[2])
    full = np.zeros((n + (extra is not None),) * 2)
    full[:n, :n] = dist + dist.T
    if extra is not None:
        full[n, :n] = full[:n, n] = norms
    return torch.from_numpy(full)


def _sign_lane(
    module: ModuleType, packed: _sign_gram.Packed, dist: NDArray[np.float64], lanes: int, t: int
) -> None:
    """Lane t of `lanes` of a chunk's sign distances into `dist`: the rows of the pairs
    (2q, 2q + 1), q = t, t + lanes, ..."""
    module.sign_distances(*packed, dist, t, lanes)


def combination_distances(sq: Tensor, coef: Tensor, n: int) -> Tensor:
    """Distances `(n,)` float64 from the first n of m points to their affine combination
    v = sum_p coef[p] P_p (`coef` `(m,)` summing to 1), from the points' squared distances
    `sq` `(m, m)`:

        ||P_i - v||^2 = sum_p coef_p D_ip - (1/2) sum_p sum_q coef_p coef_q D_pq.

    A far point's own squared length is common to its row and column and cancels because
    the coefficients sum to 1, so a tiny coefficient on it does not bring its size's
    rounding into the others' distances. Lets iterative rules (geometric median, centered
    clipping) run their steps on an (m, m) matrix after one pass over the updates."""
    cross = sq @ coef  # (m,)
    return (cross[:n] - 0.5 * float(coef @ cross)).clamp_min_(0.0).sqrt_()


def weighted_sum(updates: Updates, weights: Tensor) -> Tensor:
    """`sum_i weights[i] * updates[i]` as `(d,)` float32, accumulated in float64; one pass.

    Rows with weight zero are skipped (a source that decodes is asked for the others only);
    on the CPU the others are added one at a time into a float64 accumulator of a few
    columns, so no `(n, d)` copy is ever made, and each coordinate's sum runs over the rows
    in order, so the result does not depend on the chunk widths. Off the CPU each chunk is
    reduced at once, in float64 (`_sum_accelerator`).
    """
    vector, _ = combine(as_columns(updates, "weighted_sum"), weights, distances=False)
    return vector


def combine(
    source: Columns,
    weights: Tensor,
    *,
    base: Tensor | None = None,
    base_weight: float = 0.0,
    distances: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """One pass: z = sum_i weights[i] x_i (+ base_weight * base) `(d,)` float32 and, with
    `distances`, ||x_i - z|| `(n,)` float64 of every update to it.

    z's sum is accumulated in float64 (on the CPU over the rows in order), rounded to
    float32, then the `base` `(d,)` term added in float32; each span's distances are formed
    in float64 from the updates and the finished span of z, so iterative rules (geometric
    median, centered clipping) read the updates once per step. On CPU the column ranges
    are shared out among `torch.get_num_threads()` threads (see `_rows_pass`); elsewhere a
    few kernels per chunk.
    """
    w = weights.detach().to("cpu", torch.float64).reshape(-1).tolist()
    pairs = [(i, wi) for i, wi in enumerate(w) if wi != 0.0]
    b = None if base is None else base.detach().to(source.device, torch.float32)
    out = torch.empty(source.d, dtype=torch.float32, device=source.device)
    plan = _Pass(pairs=pairs, out=out, base=b, base_weight=base_weight, center=None)
    dist = _rows_pass(source, plan, distances)
    return out, None if dist is None else dist.sqrt()


def mean_of_rows(updates: Updates, rows: list[int]) -> Tensor:
    """Plain mean `(d,)` float32 of the given rows, accumulated in float64 (one row: its
    values, exactly); one pass reading those rows only."""
    source = as_columns(updates, "mean_of_rows")
    weights = torch.zeros(source.n, dtype=torch.float64)
    weights[rows] = 1.0 / len(rows)
    return weighted_sum(source, weights)


def distances_to(updates: Updates, center: Tensor) -> Tensor:
    """Euclidean distances `(n,)` float64 from each update to `center` `(d,)`; one pass."""
    source = as_columns(updates, "distances_to")
    c = center.detach().to(source.device)
    dist = _rows_pass(source, _Pass(pairs=[], out=None, center=c), True)
    assert dist is not None
    return dist.sqrt()


def row_norms(updates: Updates) -> Tensor:
    """L2 norm `(n,)` float64 of each update; one pass."""
    source = as_columns(updates, "row_norms")
    dist = _rows_pass(source, _Pass(pairs=[], out=None, center=None), True)
    assert dist is not None
    return dist.sqrt()


@dataclass
class _Pass:
    """What one pass over the rows computes: `out` = sum of `pairs` (row, weight) (+
    base_weight * base), and the squared distances of every row to `center`, or to `out`
    when there is an `out` and no `center`, or to zero when there is neither."""

    pairs: list[tuple[int, float]]
    out: Tensor | None  # (d,) float32
    center: Tensor | None  # (d,)
    base: Tensor | None = None  # (d,) float32
    base_weight: float = 0.0


def _rows_pass(source: Columns, plan: _Pass, distances: bool) -> Tensor | None:
    """Run `plan` over the source in one pass; the squared distances `(n,)` float64 (on the
    source's device) when `distances`, else None.

    Only rows with a weight are read when no distances are wanted (a subset chunk). On CPU,
    column ranges go to `torch.get_num_threads()` threads (`run_workers`: torch on one
    thread in each), each working through spans of `_SUM_WIDTH` columns with one kernel per
    row, each range's distances summed apart and the ranges added in order: the result
    does not depend on which thread ran what. A tensor without a budget is read as views of
    4 x `_SUM_WIDTH` columns; a source with one in chunks of its budget shared among the
    threads. A sum alone over BitDelta payloads is formed from their sign bits (`_sign_sum`).
    """
    n, d, device = source.n, source.d, source.device
    if not distances and _sign_sum(source, plan):
        return None
    subset = None
    if not distances and len(plan.pairs) < n and not _is_view_source(source):
        subset = [i for i, _ in plan.pairs]
        plan.pairs = [(j, wi) for j, (_, wi) in enumerate(plan.pairs)]  # rows of the subset
    if device.type != "cpu":
        return _rows_pass_accelerator(source, plan, distances, subset)
    threads = torch.get_num_threads()
    if source.budget is None:
        width = min(d, _SUM_WIDTH * 4)
    else:
        width = chunk_width(source, 0, parallel=threads)
    m = n if subset is None else len(subset)

    def run(span: tuple[int, int]) -> NDArray[np.float64]:
        chunk = source.columns(span[0], span[1], subset)
        return _rows_range(chunk, span[0], plan, m if distances else 0)

    parts = run_workers(run, list(spans(d, width)), threads)
    if not distances:
        return None
    total = np.zeros(m, dtype=np.float64)
    for part in parts:
        total += part
    return torch.from_numpy(total)


def _sign_sum(source: Columns, plan: _Pass) -> bool:
    """`plan`'s sum of rows over a source of BitDelta payloads from their sign bits, without
    decoding them (`_passes.sign_sum`); False (nothing done) where the source does not offer
    them, a `base` is added, or one row of weight 1 is copied (its zeros keep their sign).
    Equal weights: the values summed, exact in float64 in any order, so the sum and its one
    scaling are the decoding path's bits; other weights: one fused multiply-add per row in
    order, as `_passes.row_sum`. Column ranges go to `torch.get_num_threads()` threads."""
    module = _PASSES.module if _PASSES.enabled else None
    signs = _sign_source(source) if module is not None and plan.base is None else None
    out, pairs = plan.out, plan.pairs
    if signs is None or out is None or not pairs or (len(pairs) == 1 and pairs[0][1] == 1.0):
        return False
    assert module is not None
    rows = np.array([i for i, _ in pairs], dtype=np.int64)
    weights = {wi for _, wi in pairs}
    w = None if len(weights) == 1 else np.array([wi for _, wi in pairs], dtype=np.float64)
    threads = torch.get_num_threads()
    cap = _SIGN_SUM_BYTES if source.budget is None else source.budget // (4 * threads)
    width = min(cap, _SIGN_SUM_BYTES) // max(1, source.n // 8)
    width = min(width, -(-source.d // (4 * threads)), _SIGN_SUM_COLUMNS)  # a few per thread
    width = max(_SOURCE_ALIGN, width - width % _SOURCE_ALIGN)

    def run(span: tuple[int, int]) -> None:
        pieces = signs.sign_groups(*span)
        assert pieces is not None
        acc = np.empty(span[1] - span[0], dtype=np.float64)
        for p in pieces:
            signs_of, scales_of = p.signs.numpy(), p.scales.numpy()
            m, part = p.stop - p.start, acc[p.start : p.stop]
            module.sign_sum(signs_of, p.bit, m, p.phase, p.group, scales_of, rows, w, part)
        if w is None:
            acc *= next(iter(weights))
        out[span[0] : span[1]] = torch.from_numpy(acc)

    run_threaded(run, list(spans(source.d, width)), threads)
    return True


def _is_view_source(source: Columns) -> bool:
    """Whether the source's column ranges are views (an in-memory tensor), so reading a
    subset of rows would copy them for nothing."""
    return isinstance(source, TensorColumns)


def _rows_range(chunk: Tensor, start: int, plan: _Pass, rows: int) -> NDArray[np.float64]:
    """`plan` over one chunk `(m, c)` of columns from `start`, in spans of `_SUM_WIDTH`
    columns; the squared distances `(rows,)` of its rows (none when rows is 0)."""
    c = chunk.shape[1]
    width = min(c, _SUM_WIDTH)
    acc = torch.empty(width, dtype=torch.float64)
    ref = torch.zeros(width, dtype=torch.float64)  # the span of the centre, in float64
    diff = torch.empty(width, dtype=torch.float64)
    dist = [0.0] * rows
    centre = plan.center if plan.center is not None else plan.out
    summed = plan.out is not None and _sum_compiled(chunk, plan.pairs, plan.out[start : start + c])
    for s0, s1 in spans(c, width):
        a, r, t = acc[: s1 - s0], ref[: s1 - s0], diff[: s1 - s0]
        if plan.out is not None:
            o = plan.out[start + s0 : start + s1]
            if not summed:
                _sum_span(o, chunk[:, s0:s1], plan.pairs, a, t)
            if plan.base is not None:  # o + base_weight * base, in float32
                term = t[: s1 - s0].view(torch.float32)[: s1 - s0]
                torch.mul(plan.base[start + s0 : start + s1], plan.base_weight, out=term)
                o.add_(term)
        if rows == 0:
            continue
        if centre is not None:
            r.copy_(centre[start + s0 : start + s1])
        for i in range(rows):
            # no torch.dot: BLAS threads its dot products, and their barriers stall; the row
            # converted into t first (a mixed-dtype sub converts it into a fresh tensor)
            t.copy_(chunk[i, s0:s1])
            dist[i] += float(t.sub_(r).square_().sum())
    return np.asarray(dist, dtype=np.float64)


def _sum_span(
    out: Tensor, chunk: Tensor, pairs: list[tuple[int, float]], acc: Tensor, scratch: Tensor
) -> None:
    """out `(c,)` float32 <- sum of w_i chunk[i] over `pairs` through `_add_rows` (one row of
    weight 1: its values)."""
    if len(pairs) == 1 and pairs[0][1] == 1.0:
        out.copy_(chunk[pairs[0][0]])
    else:
        _add_rows(acc, chunk, pairs, scratch)
        out.copy_(acc)


def _sum_compiled(chunk: Tensor, pairs: list[tuple[int, float]], out: Tensor) -> bool:
    """out `(c,)` float32 <- sum of w_i chunk[i] over `pairs` by `_passes.row_sum`, when it
    is built and in use and the chunk a CPU one with contiguous rows; False (nothing done)
    otherwise. Equal weights: the rows summed in float64 in order and the sum scaled once,
    the bits of `_add_rows`; other weights: one fused multiply-add per row in order
    (`_add_rows` rounds the product first)."""
    given = _compiled_input(chunk, "fdeb")
    if given is None:
        return False
    assert _PASSES.module is not None
    kind, x = given
    rows = np.fromiter((i for i, _ in pairs), dtype=np.int64, count=len(pairs))
    weights = {wi for _, wi in pairs}
    if len(weights) <= 1:
        scale = weights.pop() if weights else 0.0
        _PASSES.module.row_sum(x, kind, rows, None, scale, out.numpy())
    else:
        w = np.fromiter((wi for _, wi in pairs), dtype=np.float64, count=len(pairs))
        _PASSES.module.row_sum(x, kind, rows, w, 1.0, out.numpy())
    return True


def _add_rows(acc: Tensor, chunk: Tensor, pairs: list[tuple[int, float]], scratch: Tensor) -> None:
    """acc `(c,)` float64 <- sum of w_i chunk[i] `(c,)` over `pairs` (i, w_i), the rows
    added one after the other in float64. When all the weights are equal (a plain mean),
    the rows are summed and the sum scaled once; on float32 and float64 rows through
    NumPy, whose mixed float64 + float32 add converts and adds in one pass (0.35 s for 45
    rows of 10M on one thread, against 0.38 s for torch's add with a scale). Other weights
    convert each row into `scratch` `(c,)` float64 first (torch's mixed-dtype add would
    convert it into a fresh tensor per row)."""
    acc.zero_()
    if not pairs:
        return
    weights = {wi for _, wi in pairs}
    if len(weights) > 1:
        for i, wi in pairs:
            acc.add_(scratch.copy_(chunk[i]), alpha=wi)
        return
    if chunk.dtype in (torch.float32, torch.float64):
        a, x = acc.numpy(), chunk.detach().numpy()
        for i, _ in pairs:
            np.add(a, x[i], out=a)
    else:
        for i, _ in pairs:
            acc.add_(chunk[i])
    acc.mul_(weights.pop())


def _rows_pass_accelerator(
    source: Columns, plan: _Pass, distances: bool, subset: list[int] | None
) -> Tensor | None:
    """`_rows_pass` off the CPU: chunks of the budget, a few kernels per chunk for the sum
    (`_sum_accelerator`) and for the distances."""
    n, device = source.n, source.device
    width = chunk_width(source, 16 if distances else 0)
    dist = torch.zeros(n, dtype=torch.float64, device=device) if distances else None
    for start, stop, chunk in chunks(source, width, subset):
        if plan.out is not None:
            _sum_accelerator(chunk, plan.pairs, plan.out[start:stop])
            if plan.base is not None:
                o = plan.out[start:stop]
                o.copy_(o + plan.base_weight * plan.base[start:stop])
        if dist is not None:
            centre = plan.center if plan.center is not None else plan.out
            diff = chunk.to(torch.float64, copy=True)  # the one (n, c) float64 temporary
            if centre is not None:
                diff.sub_(centre[start:stop].to(torch.float64))
            dist += diff.square_().sum(dim=1)
            del diff
        del chunk  # before the next is decoded: a chunk is most of the budget
    return dist


def _sum_accelerator(chunk: Tensor, pairs: list[tuple[int, float]], out: Tensor) -> None:
    """out `(c,)` float32 <- sum of w_i chunk[i] over `pairs`, in float64, off the CPU:
    equal weights as one sum over the rows scaled once (as the CPU's `_passes.row_sum`,
    which adds them in row order), others as float64 products of the weights with spans of
    the rows; one row of weight 1: its values. A few kernels a chunk, not one per row."""
    if len(pairs) == 1 and pairs[0][1] == 1.0:
        out.copy_(chunk[pairs[0][0]])
        return
    index = [i for i, _ in pairs]
    rows = chunk if index == list(range(chunk.shape[0])) else chunk[index]
    weights = {wi for _, wi in pairs}
    w = torch.tensor([wi for _, wi in pairs], dtype=torch.float64, device=chunk.device)
    # in spans: torch's sum with a wider dtype first copies its whole input into that dtype
    span = max(1, _SUM_SPAN_ACCELERATOR // (8 * len(pairs)))
    for s0, s1 in spans(out.shape[0], span):
        x = rows[:, s0:s1].to(torch.float64)
        if len(weights) == 1:
            out[s0:s1] = x.sum(0).mul_(w[0])
        else:
            out[s0:s1] = w @ x


def run_threaded(fn: Callable[[_I], _T], items: list[_I], threads: int) -> list[_T]:
    """`[fn(item) for item in items]`, the items handed out to up to `threads` threads as
    they finish the previous one (NumPy and small torch kernels release the GIL)."""
    workers = max(1, min(threads, len(items)))
    if workers == 1:
        return [fn(item) for item in items]
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(fn, items))


def run_workers(fn: Callable[[_I], _T], items: list[_I], threads: int) -> list[_T]:
    """`run_threaded`, with torch set to one thread in each worker, and the caller's count
    set back after.

    A torch kernel called from a worker thread otherwise starts its own team of
    `torch.get_num_threads()` threads (a GEMM above all, whatever its size): T workers then
    run T^2 threads on T cores, which wait on each other's barriers (the Gram matrix of
    n = 50, d = 10M took 0.98 s on two threads that way, against 0.75 s on one). Setting
    one thread is process-wide for threads that start torch work meanwhile, so it lasts
    only for the call.
    """
    if threads <= 1:
        return [fn(item) for item in items]
    before = torch.get_num_threads()

    def one(item: _I) -> _T:
        torch.set_num_threads(1)
        return fn(item)

    try:
        return run_threaded(one, items, threads)
    finally:
        torch.set_num_threads(before)


def pct(share: float) -> str:
    """Format a share in [0, 1] as a whole percentage."""
    return f"{round(100 * share)}%"
