"""The updates a quality method scores: one `(n, d)` tensor, or a source of column chunks.

A round whose decoded updates do not fit the coordinator's aggregation memory keeps its
payloads compressed and hands scoring a column source (`zoo_gym.core.columns.Columns`,
e.g. `zoo_gym.compression.columns.PayloadColumns`). A method reads one row at a time
(`row_of`), a coalition as a view of some rows (`select_rows`: a tensor for a tensor, a
`RowSubset` for a source, which the aggregation rules take as they are) or columns a chunk
at a time (`column_chunks`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

from zoo_gym.core.columns import Columns as ColumnSource
from zoo_gym.core.columns import Updates

__all__ = [
    "ColumnSource",
    "RowSubset",
    "Updates",
    "column_chunks",
    "row_of",
    "select_rows",
    "shape_of",
]


def shape_of(updates: Updates) -> tuple[int, int]:
    """(n, d) of a tensor or a source."""
    if isinstance(updates, Tensor):
        n, d = updates.shape
        return int(n), int(d)
    return updates.n, updates.d


def row_of(updates: Updates, i: int) -> Tensor:
    """Update i, `(d,)`."""
    if isinstance(updates, Tensor):
        return updates[i]
    return updates.columns(0, updates.d, rows=[i])[0]


def select_rows(updates: Updates, rows: Sequence[int]) -> Tensor | RowSubset:
    """The updates of `rows`, in that order: `(k, d)` of a tensor, or a view of the source."""
    if isinstance(updates, Tensor):
        index = torch.tensor(list(rows), dtype=torch.long, device=updates.device)
        return updates.index_select(0, index)
    return RowSubset(updates, rows)


def column_chunks(updates: Updates, max_values: int) -> Iterator[tuple[int, Tensor]]:
    """(start, `(n, width)` columns from `start`) over all d columns: chunks of at most
    `max_values` values of a tensor (views of its columns), or within a source's budget."""
    n, d = shape_of(updates)
    budget = None if isinstance(updates, Tensor) else updates.budget
    width = max(1, budget // (4 * max(n, 1)) if budget else max_values // max(n, 1))
    for start in range(0, d, width):
        stop = min(start + width, d)
        if isinstance(updates, Tensor):
            yield start, updates[:, start:stop]
        else:
            yield start, updates.columns(start, stop)


class RowSubset:
    """Some rows of a column source, as a column source of their own."""

    def __init__(self, source: ColumnSource, rows: Sequence[int]) -> None:
        self.source = source
        self.rows = list(rows)

    @property
    def n(self) -> int:
        return len(self.rows)

    @property
    def d(self) -> int:
        return self.source.d

    @property
    def dtype(self) -> torch.dtype:
        return self.source.dtype

    @property
    def device(self) -> torch.device:
        return self.source.device

    @property
    def budget(self) -> int | None:
        return self.source.budget

    def columns(self, start: int, stop: int, rows: Sequence[int] | None = None) -> Tensor:
        picked = self.rows if rows is None else [self.rows[j] for j in rows]
        return self.source.columns(start, stop, rows=picked)
