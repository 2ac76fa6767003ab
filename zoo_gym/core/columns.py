"""The shape every column source has: `(n, d)` updates read as column ranges.

Aggregation rules (`zoo_gym.aggregation`) and quality methods (`zoo_gym.scoring`) read their
updates either as one `(n, d)` tensor or through a source of this shape, which decodes or
slices each range when asked (`zoo_gym.aggregation.columns.TensorColumns`,
`zoo_gym.compression.columns.PayloadColumns`); those packages do not import each other, so
the protocol lives here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

__all__ = ["Columns", "Updates"]


@runtime_checkable
class Columns(Protocol):
    """n updates of d coordinates, read by column range."""

    @property
    def n(self) -> int: ...

    @property
    def d(self) -> int: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def budget(self) -> int | None:
        """Bytes a reader may spend on one column range and its temporaries; None for the
        in-memory defaults."""
        ...

    def columns(self, start: int, stop: int, rows: Sequence[int] | None = None) -> Tensor:
        """Columns [start, stop) of the given rows (all when None), `(len(rows), stop -
        start)`, row j being update `rows[j]`. Safe to call from several threads."""
        ...


Updates = Tensor | Columns
"""The `(n, d)` tensor or a column source."""
