"""Flower ArrayRecords as flat vectors for the robust rules.

A round's global arrays (the ArrayRecord sent) fix a `Sent` layout: keys in the record's order,
shapes, dtypes, and where each array lies in the flat `(d,)` vector. Each reply's update is its
arrays minus the arrays sent, written straight into one row of the caller's `(n, d)` float32
buffer (`subtract_into`); the values are read as NumPy views of the arrays' serialized bytes,
so neither the replies nor the global arrays are copied on the way. `apply` adds a `(d,)`
aggregate to the global arrays and returns the new ArrayRecord with the same keys, shapes and
dtypes as sent.

Rounding. For float32 arrays each delta is the float32 difference (one rounding) and each new
value the float32 sum of the global value and the aggregate. Other floating dtypes are
subtracted and added in float64 and rounded once to float32 (the delta) or to their own dtype
(the new value); integer arrays (e.g. BatchNorm's `num_batches_tracked`) take the rounded sum.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord
from numpy.typing import NDArray
from torch import Tensor

Values = NDArray[Any]


def view(array: Array) -> Values:
    """The values of a Flower `Array` as a flat NumPy array, a read-only view of its bytes.

    Arrays in Fortran order or a NumPy format other than 1.0 and 2.0 are loaded (a copy).
    """
    stream = io.BytesIO(array.data)
    version = np.lib.format.read_magic(stream)
    if version == (1, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(stream)
    elif version == (2, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_2_0(stream)
    else:
        return np.ravel(array.numpy())
    if fortran:
        return np.ravel(array.numpy())
    count = int(np.prod(shape, dtype=np.int64))
    return np.frombuffer(array.data, dtype=dtype, count=count, offset=stream.tell())


def _numeric(dtype: np.dtype[Any]) -> bool:
    return dtype.kind in "fiu"


@dataclass(frozen=True)
class Sent:
    """The arrays sent in a round, flat: `values[k]` is array `keys[k]` as a `(size,)` view,
    in `[offsets[k], offsets[k + 1])` of the flat vector."""

    keys: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    values: tuple[Values, ...]
    offsets: tuple[int, ...]  # len(keys) + 1

    @property
    def d(self) -> int:
        return self.offsets[-1]


def sent(record: ArrayRecord) -> Sent:
    """The layout and flat values of the global arrays; ValueError unless they are numeric."""
    keys, shapes, values, offsets = [], [], [], [0]
    for key, array in record.items():
        values.append(view(array))
        if not _numeric(values[-1].dtype):
            raise ValueError(
                f"array {key!r} has dtype {values[-1].dtype}; robust aggregation needs "
                "integer or floating-point arrays"
            )
        keys.append(key)
        shapes.append(tuple(array.shape))
        offsets.append(offsets[-1] + values[-1].size)
    if offsets[-1] == 0:
        raise ValueError("the arrays sent hold no values; send the model's arrays to train")
    return Sent(tuple(keys), tuple(shapes), tuple(values), tuple(offsets))


def mismatch(record: ArrayRecord, layout: Sent) -> str | None:
    """Why a reply's arrays cannot be compared with the arrays sent, or None when they can."""
    if list(record.keys()) != list(layout.keys):
        missing = sorted(set(layout.keys) - set(record.keys()))
        extra = sorted(set(record.keys()) - set(layout.keys))
        if not missing and not extra:
            return "its arrays are in another order than the arrays sent"
        return f"its keys differ from the arrays sent (missing {missing}, unexpected {extra})"
    for key, shape in zip(layout.keys, layout.shapes, strict=True):
        array = record[key]
        if tuple(array.shape) != shape:
            return f"array {key!r} has shape {tuple(array.shape)} where {shape} was sent"
        if not _numeric(np.dtype(array.dtype)):
            return f"array {key!r} has dtype {array.dtype}, not a number type"
    return None


def subtract_into(row: NDArray[np.float32], record: ArrayRecord, layout: Sent) -> None:
    """Write the reply's arrays minus the arrays sent into `row` `(d,)` float32."""
    for k, key in enumerate(layout.keys):
        out = row[layout.offsets[k] : layout.offsets[k + 1]]
        mine, base = view(record[key]), layout.values[k]
        if mine.dtype == np.float32 and base.dtype == np.float32:
            np.subtract(mine, base, out=out)
        else:
            np.subtract(mine, base, out=out, dtype=np.float64)


def apply(layout: Sent, vector: Tensor) -> ArrayRecord:
    """The arrays sent plus the `(d,)` float32 aggregate, with their keys, shapes and dtypes."""
    step = vector.detach().cpu().numpy()
    arrays = {}
    for k, key in enumerate(layout.keys):
        base = layout.values[k]
        part = step[layout.offsets[k] : layout.offsets[k + 1]]
        if base.dtype == np.float32:
            new: Values = np.add(base, part)
        elif base.dtype.kind == "f":
            new = np.add(base, part, dtype=np.float64).astype(base.dtype)
        else:
            new = np.rint(np.add(base, part, dtype=np.float64)).astype(base.dtype)
        arrays[key] = Array(new.reshape(layout.shapes[k]))
    return ArrayRecord(arrays)
