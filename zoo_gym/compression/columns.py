"""A column source over compressed payloads: aggregation straight from envelopes.

`PayloadColumns` holds n envelopes of one layout and decodes, when a rule asks for columns
[start, stop) of the flat updates (tensors concatenated in layout order, as `decode_into`
writes them), only the bytes and scales that cover that range, into one `(n, stop -
start)` float32 chunk. Its memory is the chunk and temporaries of one row's range, so
aggregating from payloads takes n x width floats, not n x d; the payloads themselves stay
as they are (bytes in memory, or a memory-mapped spool file).

Every codec decodes by range: BitDelta (all rows at once, see `_SignColumns`) from the sign bytes and group scales covering it
(any granularity: a group, a row or a whole matrix is a run of consecutive values), the
quantisers (int8, int4, int2, ternary) from their packed bytes, the raw codecs (none,
fp16, bf16) from their value bytes. Decoded values equal `decode_into`'s bit for bit.
Each tensor is read in its own codec (a version 3 envelope may have several): a tensor that
is BitDelta with one group and scale dtype in every payload goes through `_SignColumns`,
any other a row at a time.

It satisfies `zoo_gym.aggregation.columns.Columns` by its shape alone (the two pure
packages do not import each other): pass it to any rule, or to `aggregation.aggregate`.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from numpy.typing import NDArray
from torch import Tensor

from zoo_gym.compression import bitdelta, codecs
from zoo_gym.compression.envelope import (
    EnvelopeHeader,
    TensorSection,
    check_layout,
    inspect_envelope,
    section_tensors,
)
from zoo_gym.core.delta import Layout

__all__ = ["PayloadColumns", "SignPiece"]

logger = logging.getLogger(__name__)

_SLAB = 1 << 26  # bytes of one host slab on the way to the device, at most
_SCALE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
_RAW_BYTES = {"none": 4, "fp16": 2, "bf16": 2}


def _view(payload: bytes, offset: int, nbytes: int) -> Tensor:
    """A read-only uint8 tensor view of `payload[offset : offset + nbytes]`."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch warns that bytes are read-only
        return torch.frombuffer(payload, dtype=torch.uint8, count=nbytes, offset=offset)


class PayloadColumns:
    """n envelopes of one `layout`, read as column ranges of their decoded `(n, d)` float32.

    Each payload is validated once here (header, SHA-256, layout, scales, BitDelta
    padding), as `decode_into` would; content errors found while decoding a range (a
    non-finite raw value, an invalid quantiser code) raise `EnvelopeError` then. `budget`
    is the number of bytes a rule may spend per chunk (see
    `zoo_gym.aggregation.columns`).

    Where every tensor is BitDelta with one group and scale dtype in every payload and
    `resident` (by default: when `device` is not the CPU), the sign bytes and scales go to
    `device` once, here (about 1.1 bits a value; built in host slabs within `budget`), and
    each chunk is decoded there by torch ops, equal to the host decode bit for bit: no chunk
    crosses the bus. Otherwise, or where the upload runs out of device memory (one warning),
    chunks are decoded on the CPU and moved to `device`.
    """

    def __init__(
        self,
        payloads: Sequence[bytes],
        layout: Layout,
        *,
        max_elements: int,
        budget: int,
        device: torch.device | str | None = None,
        headers: Sequence[EnvelopeHeader] | None = None,
        resident: bool | None = None,
    ) -> None:
        if budget < 1:
            raise ValueError(f"budget must be a positive number of bytes, got {budget}")
        self.payloads = [bytes(p) if not isinstance(p, bytes) else p for p in payloads]
        if headers is None:
            headers = [self.check(p, layout, max_elements) for p in self.payloads]
        self.headers = list(headers)
        self._budget = budget
        self._device = torch.device("cpu" if device is None else device)
        self._starts = list(itertools.accumulate((ts.numel for ts in layout), initial=0))
        self._signs = _SignColumns.of(self.payloads, self.headers, self._starts)
        covered = set() if self._signs is None else self._signs.covered
        self._rows = [t for t in range(len(layout)) if t not in covered]  # decoded row by row
        if resident is None:
            resident = self._device.type != "cpu"
        if resident and self._signs is not None and not self._rows:
            self._upload()

    def _upload(self) -> None:
        """Sign bytes and scales to the device, or the host path where they do not fit."""
        assert self._signs is not None
        try:
            self._signs.upload(self._device, min(self._budget, _SLAB))
        except torch.OutOfMemoryError:
            logger.warning(
                "the payloads' signs and scales do not fit in %s memory: decoding column "
                "chunks on the CPU and copying them there instead",
                self._device,
            )

    @staticmethod
    def check(payload: bytes, layout: Layout, max_elements: int) -> EnvelopeHeader:
        """`payload`'s header, validated as the constructor validates each payload (pass the
        headers of payloads checked this way as `headers` to skip checking them again)."""
        header = inspect_envelope(payload, max_elements=max_elements)
        check_layout(header, layout)
        for section in header.sections:
            _, data = section_tensors(payload, section)  # scales checked there
            if section.codec == "bitdelta":
                codecs.check_padding(data, section.spec.numel, section.spec.name)
        return header

    @staticmethod
    def offers_sign_groups(headers: Sequence[EnvelopeHeader]) -> bool:
        """Whether a source over payloads of these headers (checked by `check`) offers
        `sign_groups`: every tensor BitDelta with float16 scales and one group size in all."""
        if not headers:
            return False
        return _half_scales([_sign_tensor(headers, t) for t in range(len(headers[0].sections))])

    @property
    def n(self) -> int:
        return len(self.payloads)

    @property
    def d(self) -> int:
        return self._starts[-1]

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def budget(self) -> int | None:
        return self._budget

    @property
    def resident(self) -> bool:
        """Whether chunks are decoded from sign bytes and scales held on `device`."""
        return self._signs is not None and self._signs.uploaded

    def columns(self, start: int, stop: int, rows: Sequence[int] | None = None) -> Tensor:
        """Columns [start, stop) of the decoded updates `(len(rows), stop - start)` float32
        on `device`, row j decoded from payload `rows[j]` (all payloads when None)."""
        if not 0 <= start <= stop <= self.d:
            raise ValueError(f"column range [{start}, {stop}) outside [0, {self.d})")
        order = range(self.n) if rows is None else rows
        where = torch.device("cpu") if self._signs is None else self._signs.device
        out = torch.empty((len(order), stop - start), dtype=torch.float32, device=where)
        if self._signs is not None:
            self._signs.decode(rows, start, stop, out)
        pieces = [t for t in self._rows if self._starts[t] < stop and start < self._starts[t + 1]]
        if pieces:
            for j, i in enumerate(order):
                self._decode_row(i, pieces, start, stop, out[j])
        return out.to(self._device)

    def sign_groups(self, start: int, stop: int) -> list[SignPiece] | None:
        """Columns [start, stop) as their signs and group scales, one `SignPiece` per tensor
        they cover, on the CPU; None unless every tensor is BitDelta with float16 scales
        and one group size in every payload. The value of row i in column j of a piece is
        +scale if sign bit j of row i is set, else -scale, scale being row i's scale of j's
        group (see `SignPiece`)."""
        if not 0 <= start <= stop <= self.d:
            raise ValueError(f"column range [{start}, {stop}) outside [0, {self.d})")
        if self._signs is None or self._rows or not self._signs.half_scales:
            return None
        return self._signs.pieces(start, stop)

    def _decode_row(self, i: int, tensors: list[int], start: int, stop: int, out: Tensor) -> None:
        """Values [start, stop) of `tensors` (indices into the layout) of payload i's flat
        update into `out` (stop - start,)."""
        payload, header = self.payloads[i], self.headers[i]
        for t in tensors:
            t0, t1 = self._starts[t], self._starts[t + 1]
            lo, hi = max(start, t0) - t0, min(stop, t1) - t0
            if lo >= hi:
                continue
            target = out[t0 + lo - start : t0 + hi - start]
            _decode_range(payload, header.sections[t], lo, hi, target)


def _decode_range(payload: bytes, section: TensorSection, lo: int, hi: int, out: Tensor) -> None:
    """Values [lo, hi) of one tensor of an envelope into `out` (hi - lo,) float32, reading
    only the bytes and scales that cover them."""
    codec, n, group = section.codec, section.spec.numel, section.group
    if codec in _RAW_BYTES:
        size = _RAW_BYTES[codec]
        data = _view(payload, section.data_offset + lo * size, (hi - lo) * size)
        codecs.decode_range(codec, torch.empty(0), 0, data, lo, n, lo, hi, group, out)
        return
    per_byte = codecs.values_per_byte(codec)
    b0, b1 = lo // per_byte, -(-hi // per_byte)
    g0, g1 = lo // group, (hi - 1) // group + 1
    scale_dtype = section.codec_spec.scale_dtype
    width = _SCALE_BYTES[scale_dtype]
    raw = _view(payload, section.scales_offset + g0 * width, (g1 - g0) * width)
    scales = raw.view(codecs.SCALE_TORCH_DTYPES[scale_dtype]).float()
    data = _view(payload, section.data_offset + b0, b1 - b0)
    codecs.decode_range(codec, scales, g0, data, b0, n, lo, hi, group, out)


@dataclass(frozen=True)
class _SignTensor:
    """One tensor of n BitDelta envelopes: its size, group, and where each payload keeps
    its sign bytes and scales."""

    numel: int
    group: int
    n_groups: int
    scale_dtype: torch.dtype
    scale_bytes: int
    data: tuple[int, ...]  # (n,) byte offset of the tensor's sign bytes in each payload
    scales: tuple[int, ...]  # (n,) byte offset of its scales in each payload

    @property
    def nbytes(self) -> int:
        return -(-self.numel // 8)

    @property
    def padded_groups(self) -> int:
        """Groups that values up to the end of the last byte reach (beyond `n_groups` when
        that byte's padding passes the last group)."""
        return max(self.n_groups, -(-self.nbytes * 8 // self.group))


@dataclass(frozen=True)
class SignPiece:
    """Columns [start, stop) of a range, all in one BitDelta tensor, as signs and scales.

    Row i's value in column start + j is +s if bit `bit + j` of row i of `signs` is set
    (bits most significant first in each byte, as BitDelta packs them), else -s, where s
    is `scales[i, (phase + j) // group]`: groups of `group` consecutive values of the
    tensor, the piece's first value being value `phase` of its first group."""

    start: int
    stop: int
    group: int
    phase: int
    scales: Tensor  # (n, groups) float32, the groups the piece covers
    signs: Tensor  # (n, ceil((bit + stop - start) / 8)) uint8, the sign bytes
    bit: int  # the first value's bit in the first byte, 0..7


class _Rows(Protocol):
    """The sign bytes and scales of one tensor for some rows (m of them), and the table
    lookup that turns bytes into +-1 values, on the device the values are written on."""

    m: int
    device: torch.device

    def signs(self, tensor: int, first: int, count: int) -> Tensor:
        """Bytes [first, first + count) of the tensor in each row, (m, count) uint8."""
        ...

    def scales(self, tensor: int, first: int, count: int) -> Tensor:
        """Scales [first, first + count) of the tensor in each row (0 from its `n_groups`
        on), (m, count) float32."""
        ...

    def values(self, signs: Tensor, target: Tensor) -> None:
        """The +-1.0 values of `signs` (m, k) uint8 into `target` (m, 8 k) float32."""
        ...


class _HostRows:
    """Rows read from the payloads' bytes in host memory, copied per range."""

    device = torch.device("cpu")

    def __init__(
        self,
        arrays: list[NDArray[np.uint8]],
        tensors: list[_SignTensor | None],
        rows: Sequence[int],
    ) -> None:
        self._arrays, self._tensors, self._rows = arrays, tensors, rows
        self.m = len(rows)

    def signs(self, tensor: int, first: int, count: int) -> Tensor:
        t = self._tensors[tensor]
        assert t is not None
        return torch.from_numpy(self._gather(t.data, first, count, t.nbytes, 1))

    def scales(self, tensor: int, first: int, count: int) -> Tensor:
        t = self._tensors[tensor]
        assert t is not None
        raw = self._gather(t.scales, first, count, t.n_groups, t.scale_bytes)
        return torch.from_numpy(raw).view(t.scale_dtype).float()

    def values(self, signs: Tensor, target: Tensor) -> None:
        packed, values = signs.numpy(), target.view(self.m, -1, 8).numpy()  # (m, k, 8)
        if values.flags.c_contiguous:
            bitdelta.sign_values_into(packed, values)
        else:  # a part of the chunk's rows: NumPy would take into a copy and write it back
            for j in range(self.m):
                bitdelta.sign_values_into(packed[j], values[j])

    def _gather(
        self, offsets: tuple[int, ...], first: int, count: int, avail: int, width: int
    ) -> NDArray[np.uint8]:
        """(m, count * width) bytes: items [first, first + count) of `width` bytes each
        from `offsets[i]` of each payload i in the rows, zeros for items from `avail` on."""
        real = max(0, min(count, avail - first)) * width
        out = np.empty((self.m, count * width), dtype=np.uint8)
        out[:, real:] = 0
        rows = np.asarray(self._rows, dtype=np.int64)
        starts = np.asarray(offsets, dtype=np.int64)[rows] + first * width
        bitdelta.gather_rows([self._arrays[i] for i in rows.tolist()], starts, out[:, :real])
        return out


class _DeviceRows:
    """Rows read from the sign bytes and scales held on the device (see `_Resident`)."""

    def __init__(self, resident: _Resident, rows: Sequence[int] | None) -> None:
        self._resident = resident
        self.device = resident.device
        self._index = None
        if rows is not None:
            self._index = torch.tensor(list(rows), dtype=torch.long, device=self.device)
        self.m = resident.n if rows is None else len(rows)

    def signs(self, tensor: int, first: int, count: int) -> Tensor:
        return self._select(self._resident.signs[tensor][:, first : first + count])

    def scales(self, tensor: int, first: int, count: int) -> Tensor:
        return self._select(self._resident.scales[tensor][:, first : first + count]).float()

    def values(self, signs: Tensor, target: Tensor) -> None:
        index = signs.to(torch.int32).reshape(-1)  # (m k,): one copy of the sliced view
        table = self._resident.table
        if target.is_contiguous():
            torch.index_select(table, 0, index, out=target.view(-1, 8))
        else:  # the tensor's part of a chunk that spans several tensors
            target.view(self.m, -1, 8).copy_(table.index_select(0, index).view(self.m, -1, 8))

    def _select(self, columns: Tensor) -> Tensor:
        return columns if self._index is None else columns.index_select(0, self._index)


class _Resident:
    """The sign bytes `(n, ceil(numel / 8))` uint8 and scales `(n, padded_groups)` (in the
    payloads' scale dtype, zero past `n_groups`) of every tensor, uploaded to `device` once,
    and the `(256, 8)` float32 sign table there. The host builds them in slabs of at most
    `budget` bytes (a row longer than that in several), never a whole `(n, bytes)` copy."""

    def __init__(
        self,
        arrays: list[NDArray[np.uint8]],
        tensors: list[_SignTensor],
        device: torch.device,
        budget: int,
    ) -> None:
        self.n, self.device = len(arrays), device
        self.table = bitdelta.sign_values(torch.arange(256, dtype=torch.uint8)).view(256, 8)
        self.table = self.table.to(device)
        self.signs: list[Tensor] = []
        self.scales: list[Tensor] = []
        for t in tensors:
            signs = torch.empty((self.n, t.nbytes), dtype=torch.uint8, device=device)
            _upload(arrays, t.data, signs, budget)
            scales = torch.zeros(
                (self.n, t.padded_groups * t.scale_bytes), dtype=torch.uint8, device=device
            )
            _upload(arrays, t.scales, scales[:, : t.n_groups * t.scale_bytes], budget)
            self.signs.append(signs)
            self.scales.append(scales.view(t.scale_dtype))


def _upload(
    arrays: list[NDArray[np.uint8]], offsets: tuple[int, ...], out: Tensor, budget: int
) -> None:
    """Bytes [offsets[i], offsets[i] + width) of each payload i into row i of `out` (n,
    width) uint8 on its device, through host slabs of at most `budget` bytes."""
    n, width = out.shape
    cols = max(1, min(width, budget))
    step = max(1, budget // cols)
    slab = np.empty((min(n, step), cols), dtype=np.uint8)
    for c0 in range(0, width, cols):
        c = min(cols, width - c0)
        for r0 in range(0, n, step):
            r = min(step, n - r0)
            for j in range(r):
                at = offsets[r0 + j] + c0
                slab[j, :c] = arrays[r0 + j][at : at + c]
            out[r0 : r0 + r, c0 : c0 + c].copy_(torch.from_numpy(slab[:r, :c]))


class _SignColumns:
    """Column ranges of the BitDelta tensors of n envelopes of one layout, decoded for all
    rows at once.

    A tensor is taken (`covered`) when it is BitDelta with one group and scale dtype in
    every payload: a column range then covers the same bytes and groups of every payload,
    so they are computed once per tensor, the rows' bytes and scales taken as one `(m,
    bytes)` and one `(m, groups)` array, and the values written by one sign-table lookup and
    one scaling per group run straight into the output chunk. Values of a range that starts
    or ends inside a byte are decoded from that byte into an `(m, 8)` scratch and copied.

    The bytes and scales are copied per range from the payloads in host memory, or, after
    `upload`, sliced from their copies on a device, where the chunk is then written.
    """

    def __init__(
        self,
        payloads: Sequence[bytes],
        tensors: list[_SignTensor | None],
        starts: list[int],
    ) -> None:
        self._starts = starts  # (T + 1,) first column of each tensor, then d
        self._arrays = [np.frombuffer(p, dtype=np.uint8) for p in payloads]
        self._tensors = tensors
        self.covered = frozenset(t for t, tensor in enumerate(tensors) if tensor is not None)
        self._resident: _Resident | None = None

    @classmethod
    def of(
        cls, payloads: Sequence[bytes], headers: Sequence[EnvelopeHeader], starts: list[int]
    ) -> _SignColumns | None:
        """The decoder of these payloads' BitDelta tensors, or None when no tensor is BitDelta
        with one group and scale dtype in every payload."""
        if not headers:
            return None
        tensors = [_sign_tensor(headers, t) for t in range(len(headers[0].sections))]
        if all(tensor is None for tensor in tensors):
            return None
        return cls(payloads, tensors, starts)

    @property
    def uploaded(self) -> bool:
        return self._resident is not None

    @property
    def half_scales(self) -> bool:
        """Whether every tensor is covered, with float16 scales."""
        return _half_scales(self._tensors)

    def pieces(self, start: int, stop: int) -> list[SignPiece]:
        """Columns [start, stop) as one `SignPiece` per tensor they cover (all covered), read
        from the payloads in host memory."""
        rows = _HostRows(self._arrays, self._tensors, range(len(self._arrays)))
        out = []
        for t, lo, hi, at in self._pieces(start, stop):
            tensor = self._tensors[t]
            assert tensor is not None
            b0, g0 = lo // 8, lo // tensor.group
            signs = rows.signs(t, b0, -(-hi // 8) - b0)
            scales = rows.scales(t, g0, (hi - 1) // tensor.group + 1 - g0)
            group_phase, bit = lo - g0 * tensor.group, lo - 8 * b0
            out.append(SignPiece(at, at + hi - lo, tensor.group, group_phase, scales, signs, bit))
        return out

    def _pieces(self, start: int, stop: int) -> Iterator[tuple[int, int, int, int]]:
        """(t, lo, hi, at) for each tensor t that columns [start, stop) cover: its values
        [lo, hi), at column `at` of the range."""
        t = bisect.bisect_right(self._starts, start) - 1
        while t < len(self._tensors) and self._starts[t] < stop:
            t0 = self._starts[t]
            lo, hi = max(start, t0) - t0, min(stop, self._starts[t + 1]) - t0
            if lo < hi:
                yield t, lo, hi, t0 + lo - start
            t += 1

    @property
    def device(self) -> torch.device:
        """Where `decode` writes: the CPU, or the device of the uploaded bytes."""
        return torch.device("cpu") if self._resident is None else self._resident.device

    def upload(self, device: torch.device, budget: int) -> None:
        """Copy the sign bytes and scales of every tensor (all covered) to `device` once,
        through host slabs of at most `budget` bytes; ranges are decoded there from then on.
        Raises `torch.OutOfMemoryError` where they do not fit, leaving the host path."""
        tensors = [t for t in self._tensors if t is not None]
        if len(tensors) != len(self._tensors):
            raise ValueError("only payloads whose every tensor is covered can be uploaded")
        self._resident = _Resident(self._arrays, tensors, device, budget)

    def decode(self, rows: Sequence[int] | None, start: int, stop: int, out: Tensor) -> None:
        """Columns [start, stop) of payloads `rows` (all, in order, when None) into `out`
        (len(rows), stop - start) on `device`."""
        source: _Rows
        if self._resident is None:
            order = range(len(self._arrays)) if rows is None else rows
            source = _HostRows(self._arrays, self._tensors, order)
        else:
            source = _DeviceRows(self._resident, rows)
        for t, lo, hi, at in self._pieces(start, stop):
            tensor = self._tensors[t]
            if tensor is not None:
                _decode_piece(source, t, tensor.group, lo, hi, out[:, at : at + hi - lo])


def _decode_piece(source: _Rows, t: int, group: int, lo: int, hi: int, target: Tensor) -> None:
    """Values [lo, hi) of tensor `t` into `target` (m, hi - lo): the whole bytes in place,
    the values of a byte cut by lo or hi through a scratch."""
    a0, a1 = -(-lo // 8) * 8, hi // 8 * 8
    if a0 < a1:
        _decode_span(source, t, group, a0, a1, target[:, a0 - lo : a1 - lo])
    edges = [(lo, min(a0, hi))] if lo < a0 else []
    if a0 <= a1 < hi:
        edges.append((a1, hi))
    for e0, e1 in edges:
        base = e0 // 8 * 8
        scratch = torch.empty((source.m, 8), dtype=torch.float32, device=source.device)
        _decode_span(source, t, group, base, base + 8, scratch)
        target[:, e0 - lo : e1 - lo].copy_(scratch[:, e0 - base : e1 - base])


def _decode_span(source: _Rows, t: int, group: int, v0: int, v1: int, target: Tensor) -> None:
    """Values [v0, v1) (whole bytes; v1 may pass the tensor's end inside its last byte)
    of tensor `t` into `target` (m, v1 - v0), unit stride along a row."""
    g0, g1 = v0 // group, -(-v1 // group)
    source.values(source.signs(t, v0 // 8, (v1 - v0) // 8), target)
    _scale_groups(target, source.scales(t, g0, g1 - g0), v0, v1, group)


def _scale_groups(target: Tensor, scales: Tensor, v0: int, v1: int, group: int) -> None:
    """Multiply values [v0, v1) of a tensor, held in `target` (m, v1 - v0) (unit stride
    along a row, on any device), by their groups' scales `scales` (m, groups from v0 //
    group on) float32, in place: one multiplication for each run of whole groups and one
    for each cut group at either end."""
    m, g0, g1 = target.shape[0], v0 // group, -(-v1 // group)
    head = min(v1, (g0 + 1) * group) - v0  # the values of group g0
    target[:, :head].mul_(scales[:, :1])
    if g1 - g0 > 1:
        last = (g1 - 1) * group - v0  # where the last group starts
        middle = target[:, head:last].view(m, g1 - g0 - 2, group)
        middle.mul_(scales[:, 1:-1, None])
        target[:, last:].mul_(scales[:, -1:])


def _half_scales(tensors: Sequence[_SignTensor | None]) -> bool:
    """Whether every tensor is BitDelta in all payloads (`_sign_tensor`), with float16 scales."""
    return all(t is not None and t.scale_dtype == torch.float16 for t in tensors)


def _sign_tensor(headers: Sequence[EnvelopeHeader], t: int) -> _SignTensor | None:
    """Tensor `t` of every payload for `_SignColumns`, or None unless it is BitDelta with one
    group and scale dtype in all of them."""
    sections = [h.sections[t] for h in headers]
    first = sections[0]
    spec = first.codec_spec
    if any(
        s.codec != "bitdelta"
        or s.group != first.group
        or s.codec_spec.scale_dtype != spec.scale_dtype
        for s in sections
    ):
        return None
    return _SignTensor(
        numel=first.spec.numel,
        group=first.group,
        n_groups=first.n_groups,
        scale_dtype=codecs.SCALE_TORCH_DTYPES[spec.scale_dtype],
        scale_bytes=_SCALE_BYTES[spec.scale_dtype],
        data=tuple(s.data_offset for s in sections),
        scales=tuple(s.scales_offset for s in sections),
    )
