"""Column sources: how a rule reads the `(n, d)` updates without holding them whole.

A rule reads its updates only as column ranges `(n, stop - start)` of all n updates (or of
some of them), through `Columns.columns(start, stop, rows)`. The in-memory `(n, d)` tensor
is one source (`TensorColumns`, whose ranges are views); a source over compressed payloads
decodes each range when asked (`zoo_gym.compression.columns.PayloadColumns`), so a rule's
memory is set by its source's `budget` and not by n x d.

`budget` is the number of bytes a rule may spend on one column range: the range itself and
the rule's temporaries of the same shape. A rule picks widths of
`budget // (n * (its bytes per value + the source's))` columns (see `_core.chunk_width`);
beyond that it keeps O(n^2) float64 matrices and its `(d,)` output. A source with
`budget=None` is the in-memory tensor at its default widths (1% of the input, as
before), which is what a plain tensor argument means.

A source may also offer `sign_groups(start, stop)` (optional, see `SignGroups`): a range of
BitDelta values as sign bits and per-group scales, from which the coordinate-wise rules
select order statistics without sorting (`_signs`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import Tensor

from zoo_gym.core.columns import Columns, Updates

__all__ = [
    "Columns",
    "MixedColumns",
    "ScaledColumns",
    "SignGroups",
    "SignPiece",
    "TensorColumns",
    "Updates",
    "cached",
]


class SignPiece(Protocol):
    """Columns [start, stop) of a range, all in one BitDelta tensor: row i's value in
    column start + j is +s if bit `bit + j` of row i of `signs` is set (most significant
    first in each byte), else -s, s = `scales[i, (phase + j) // group]` (groups of `group` consecutive values; the piece starts at value `phase` of
    its first group)."""

    @property
    def start(self) -> int: ...

    @property
    def stop(self) -> int: ...

    @property
    def group(self) -> int: ...

    @property
    def phase(self) -> int: ...

    @property
    def scales(self) -> Tensor:
        """`(n, groups)` float32 on the CPU, float16 values, not negative."""
        ...

    @property
    def signs(self) -> Tensor:
        """`(n, ceil((bit + stop - start) / 8))` uint8 on the CPU."""
        ...

    @property
    def bit(self) -> int: ...


class SignGroups(Protocol):
    """The optional method of a source whose values are signs times group scales."""

    def sign_groups(self, start: int, stop: int) -> Sequence[SignPiece] | None:
        """Columns [start, stop) as pieces covering them in order, or None where the source
        is not all BitDelta with float16 scales."""
        ...


class TensorColumns:
    """The in-memory `(n, d)` tensor as a column source: column ranges are views (a subset
    of rows is gathered). `budget` None keeps the rules' default widths; a number of bytes
    makes them read narrower ranges, as any other source."""

    def __init__(self, updates: Tensor, *, budget: int | None = None) -> None:
        if updates.dim() != 2:
            raise ValueError(f"updates must be one (n, d) tensor, got shape {tuple(updates.shape)}")
        if budget is not None and budget < 1:
            raise ValueError(f"budget must be a positive number of bytes, got {budget}")
        self.updates = updates.detach()
        self._budget = budget

    @property
    def n(self) -> int:
        return int(self.updates.shape[0])

    @property
    def d(self) -> int:
        return int(self.updates.shape[1])

    @property
    def dtype(self) -> torch.dtype:
        return self.updates.dtype

    @property
    def device(self) -> torch.device:
        return self.updates.device

    @property
    def budget(self) -> int | None:
        return self._budget

    def columns(self, start: int, stop: int, rows: Sequence[int] | None = None) -> Tensor:
        view = self.updates[:, start:stop]
        if rows is None:
            return view
        return view.index_select(0, torch.as_tensor(list(rows), device=view.device))


_CACHE_SPAN = 1 << 16  # columns read at a time by `cached`


def cached(source: Columns) -> Columns:
    """A source for a rule that reads its updates more than once: `source` itself, or, when
    all of it `(n, d)` fits in half the source's budget, all of it read once into memory
    (a `TensorColumns` of views whose budget is what is left for chunk temporaries), so
    later passes do not decode it again. A source without a budget, or already in memory,
    is returned as it is."""
    budget = source.budget
    if budget is None or isinstance(source, TensorColumns):
        return source
    size = source.n * source.d * (torch.finfo(source.dtype).bits // 8)
    if size > budget // 2:
        return source
    # read in spans: each span's temporaries stay small, and the copy (on torch's threads)
    # faults the fresh pages in (n = 100, d = 1M: 0.18-0.25 s against 0.30 s in one call)
    whole = torch.empty((source.n, source.d), dtype=source.dtype, device=source.device)
    for start in range(0, source.d, _CACHE_SPAN):
        stop = min(source.d, start + _CACHE_SPAN)
        whole[:, start:stop].copy_(source.columns(start, stop))
    return TensorColumns(whole, budget=budget - size)


class _Derived:
    """What a source computed from another `source` shares with it: its shape and device,
    float32 values, and a `1 / share` part of its byte budget (each range also holds the
    inner range and the derived temporaries)."""

    share = 1

    def __init__(self, source: Columns) -> None:
        self.source = source

    @property
    def n(self) -> int:
        return self.source.n

    @property
    def d(self) -> int:
        return self.source.d

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    @property
    def device(self) -> torch.device:
        return self.source.device

    @property
    def budget(self) -> int | None:
        inner = self.source.budget
        return None if inner is None else max(1, inner // self.share)


class MixedColumns(_Derived):
    """Rows `mix @ X` of another source X, computed range by range: `mix` `(n, n)` float64,
    results float32 (nearest-neighbour mixing as a source). Its budget is a sixth of the
    inner source's, since each range also holds the inner range and the sum in float64.
    Values agree with the in-memory `mix @ X` (a float64 GEMM) to float64 rounding before
    the float32 result is rounded."""

    share = 6

    def __init__(self, source: Columns, mix: Tensor) -> None:
        super().__init__(source)
        self.mix = mix.to(source.device, torch.float64)  # (n, n)

    def columns(self, start: int, stop: int, rows: Sequence[int] | None = None) -> Tensor:
        mix = self.mix if rows is None else self.mix[list(rows)]  # (k, n)
        x = self.source.columns(start, stop).to(torch.float64)  # (n, c)
        # summed over the updates in order, so a value does not depend on the chunk width
        # and rows with the same neighbours are equal (ties stay ties)
        acc = torch.zeros((mix.shape[0], stop - start), dtype=torch.float64, device=x.device)
        for j in range(x.shape[0]):
            acc.addcmul_(mix[:, j : j + 1], x[j : j + 1])
        return acc.to(torch.float32)


class ScaledColumns(_Derived):
    """Rows of another source, each multiplied by its `scale` `(n,)`, as float32 (clipped
    updates as a source)."""

    share = 2

    def __init__(self, source: Columns, scale: Tensor) -> None:
        super().__init__(source)
        self.scale = scale.to(source.device, torch.float32)  # (n,)

    def columns(self, start: int, stop: int, rows: Sequence[int] | None = None) -> Tensor:
        scale = self.scale if rows is None else self.scale[list(rows)]
        x = self.source.columns(start, stop, rows).to(torch.float32)
        return x * scale[:, None]
