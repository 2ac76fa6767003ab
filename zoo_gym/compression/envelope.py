"""The versioned envelope that carries one compressed delta.

All integers are little-endian (`struct` format in brackets). `encode` writes version 2 when
every tensor uses the envelope's codec and version 3 when some tensor has its own; readers take
versions 1, 2 and 3. Version 1:

==========  ==================================================================================
bytes       field
==========  ==================================================================================
4           magic ``b"ZGDE"``
2 [H]       format version, 1
1 [B]       codec id: none 0, fp16 1, bf16 2, bitdelta 3, int8 4, int4 5, int2 6, ternary 7
1 [B]       granularity id: group 0, row 1, matrix 2
4 [I]       group size (>= 1)
1 [B]       scale dtype id: float16 0, bfloat16 1, float32 2
3           reserved, zero
4 [I]       tensor count T
per tensor  name length [H], name (UTF-8, names strictly increasing as in `layout_of`),
            dtype id [B] (float32 0, float16 1, bfloat16 2, float64 3), ndim [B] (<= 8),
            shape (ndim x [Q])
per tensor  scales (G values of the scale dtype, G = ceil(n / group length)), then packed
            values (`zoo_gym.compression.codecs.data_nbytes` bytes), in table order
32          SHA-256 of every byte before it
==========  ==================================================================================

Version 2 is version 1 with the per-tensor table deflated: after the tensor count, 4 [I] bytes
give the length L of a zlib stream (RFC 1950) holding exactly version 1's per-tensor table, and
the L bytes follow; the rest is unchanged. A table of LoRA modules repeats its names' prefixes
(``model.layers.11.mlp.down_proj.lora_B``): the 168 entries of a 24-layer model take 9.6 KB
inline and 0.5 KB deflated, which is the difference between 13.8x and 14.2x smaller than bf16
for the rank-8 update of a 0.5B model. A reader inflates at most `MAX_TABLE_BYTES`.

Version 3 is version 2 with a codec per tensor: each entry of the (deflated) per-tensor table
ends with that tensor's codec id [B], granularity id [B], group size [I] and scale dtype id [B],
with the ids and limits of the header's; the tensor's scales and values are in that codec. The
header's codec parameters are the envelope's own (those `encode` was given), which a reader
may check against what it expects; decoding follows the entries. The first round of an epoch
of FFA-LoRA's A sends its carried Bs this way, in a more precise codec than the update's.

The group length of a tensor of n values is the group size (granularity ``group``),
``n / shape[0]`` (``row``) or ``n`` (``matrix``); the codecs without scales store none. Every
size follows from the table, so a reader checks the declared sizes against the byte length
and ``max_elements`` before it allocates anything; the dtype is informational (decoding always
yields float32).
"""

from __future__ import annotations

import functools
import hashlib
import math
import struct
import sys
import warnings
import zlib
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from zoo_gym.compression import bitdelta, codecs, kernels
from zoo_gym.compression.errors import EnvelopeError
from zoo_gym.compression.spec import (
    CODEC_IDS,
    GRANULARITIES,
    SCALE_DTYPES,
    CodecSpec,
    group_length,
    n_groups,
)
from zoo_gym.core.delta import Delta, Layout, TensorSpec

MAGIC = b"ZGDE"
VERSION = 2  # what `encode` writes when every tensor uses the envelope's codec
MIXED_VERSION = 3  # what it writes when some tensor has a codec of its own
VERSIONS = (1, 2, 3)  # what `inspect_envelope` reads
MAX_TABLE_BYTES = 16 << 20  # an inflated version 2 table larger than this is refused
_TABLE_LENGTH = struct.Struct("<I")
MAX_NDIM = 8
_HEAD = struct.Struct("<4sHBBIB3xI")
_NAME = struct.Struct("<H")
_DTYPE_NDIM = struct.Struct("<BB")
_OWN_CODEC = struct.Struct("<BBIB")  # version 3: codec, granularity, group size, scale dtype
_DIGEST = 32
DTYPE_IDS = {"float32": 0, "float16": 1, "bfloat16": 2, "float64": 3}
_SCALE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
_CODEC_NAMES = {v: k for k, v in CODEC_IDS.items()}
_DTYPE_NAMES = {v: k for k, v in DTYPE_IDS.items()}
_TORCH_DTYPE_IDS = {getattr(torch, name): i for name, i in DTYPE_IDS.items()}


@dataclass(frozen=True)
class TensorSection:
    """Where one tensor's scales and packed values lie in the payload, and its codec."""

    spec: TensorSpec
    codec_spec: CodecSpec
    group: int
    n_groups: int
    scales_offset: int
    scales_nbytes: int
    data_offset: int
    data_nbytes: int

    @property
    def codec(self) -> str:
        return self.codec_spec.codec


@dataclass(frozen=True)
class EnvelopeHeader:
    """The validated header of an envelope: codec, parameters, layout and sizes."""

    version: int
    spec: CodecSpec
    layout: Layout
    sections: tuple[TensorSection, ...]
    total_elements: int
    header_nbytes: int
    payload_nbytes: int
    total_nbytes: int

    @property
    def codec(self) -> str:
        """The envelope's codec (a version 3 envelope's tensors may each have their own)."""
        return self.spec.codec

    @property
    def mixed(self) -> bool:
        """Whether some tensor has other codec parameters than the envelope's."""
        return any(section.codec_spec != self.spec for section in self.sections)


def _tensor_bytes(t: Tensor) -> memoryview:
    """The bytes of `t` as a view (copied only when not already contiguous on the CPU)."""
    return t.detach().cpu().contiguous().view(torch.uint8).numpy().data


def encode(delta: Delta, spec: CodecSpec, *, own: Mapping[str, CodecSpec] | None = None) -> bytes:
    """Compress `delta` into one envelope (format in the module docstring).

    Tensors may have any floating dtype and live on any device; they are compressed as float32
    in `layout_of` order (sorted by name), each with `spec`, or with ``own[name]`` where `own`
    names it (a version 3 envelope when that differs from `spec`; otherwise version 2, byte
    for byte what it was before version 3). Raises ValueError for non-float or non-finite
    tensors, for scales that overflow their scale dtype and for a name in `own` that is not
    in `delta`.
    """
    if sys.byteorder != "little":
        raise RuntimeError("the envelope is written on little-endian hosts only")
    own = own or {}
    unknown = sorted(set(own) - set(delta))
    if unknown:
        raise ValueError(f"{unknown[0]}: a codec is given for a tensor the delta does not have")
    names = sorted(delta)
    tensors = [delta[name] for name in names]
    specs = [own.get(name, spec) for name in names]
    mixed = any(s != spec for s in specs)
    chunks: list[bytes | memoryview] = [_table(names, tensors, spec, specs if mixed else None)]
    chunks += _sections(names, tensors, specs)
    digest = hashlib.sha256()
    for chunk in chunks:  # hashed where they lie, joined once with the digest
        digest.update(chunk)
    chunks.append(digest.digest())
    return b"".join(chunks)


def _sections(
    names: list[str], tensors: list[Tensor], specs: list[CodecSpec]
) -> list[bytes | memoryview]:
    """Scales and packed values of every tensor, in table order: the BitDelta tensors of one
    group size and scale dtype from one `pack_many` pass, the others one at a time."""
    by_spec: dict[CodecSpec, list[int]] = {}
    for i, spec in enumerate(specs):
        by_spec.setdefault(spec, []).append(i)
    parts: list[bytes | memoryview] = [b""] * (2 * len(names))
    for spec, index in by_spec.items():
        if spec.codec == "bitdelta" and spec.granularity == "group":
            packed = _bitdelta_sections(
                [names[i] for i in index], [tensors[i] for i in index], spec
            )
            for j, i in enumerate(index):
                parts[2 * i : 2 * i + 2] = packed[2 * j : 2 * j + 2]
            continue
        for i in index:
            x = tensors[i].detach().reshape(-1).to(torch.float32).contiguous()
            _check_finite(names[i], x)
            group = group_length(spec, tuple(tensors[i].shape))
            scales, data = codecs.encode_tensor(spec.codec, x, group, spec.scale_dtype)
            parts[2 * i : 2 * i + 2] = [
                _tensor_bytes(scales) if spec.scaled else b"",
                _tensor_bytes(data),
            ]
    return parts


@functools.cache
def _entry(name_nbytes: int, ndim: int) -> struct.Struct:
    """One tensor table entry: name length, name, dtype id, ndim, shape."""
    return struct.Struct(f"<H{name_nbytes}sBB{ndim}Q")


def _codec_ids(spec: CodecSpec) -> tuple[int, int, int, int]:
    """The header's (and a version 3 entry's) codec id, granularity id, group size and scale
    dtype id of `spec`."""
    return (
        CODEC_IDS[spec.codec],
        GRANULARITIES.index(spec.granularity),
        spec.group_size,
        SCALE_DTYPES.index(spec.scale_dtype),
    )


def _table(
    names: list[str], tensors: list[Tensor], spec: CodecSpec, specs: list[CodecSpec] | None
) -> bytes:
    """The header and the deflated tensor table (version 2, or version 3 with the codec of each
    tensor in `specs`; module docstring), as one piece."""
    version = VERSION if specs is None else MIXED_VERSION
    head = _HEAD.pack(MAGIC, version, *_codec_ids(spec), len(names))
    table = zlib.compress(_entries(names, tensors, specs), 9)
    return head + _TABLE_LENGTH.pack(len(table)) + table


def _entries(names: list[str], tensors: list[Tensor], specs: list[CodecSpec] | None) -> bytes:
    """Version 1's per-tensor table: name, dtype id, ndim and shape of each tensor, and with
    `specs` (version 3) each tensor's codec parameters after its shape."""
    parts = []
    for i, (name, t) in enumerate(zip(names, tensors, strict=True)):
        dtype_id = _TORCH_DTYPE_IDS.get(t.dtype)
        if dtype_id is None:
            raise ValueError(
                f"{name}: dtype {str(t.dtype).removeprefix('torch.')} is not a float type"
            )
        shape = t.shape
        if len(shape) > MAX_NDIM:
            raise ValueError(f"{name}: {len(shape)} dimensions, at most {MAX_NDIM}")
        encoded = name.encode("utf-8")
        entry = _entry(len(encoded), len(shape))
        parts.append(entry.pack(len(encoded), encoded, dtype_id, len(shape), *shape))
        if specs is not None:
            parts.append(_OWN_CODEC.pack(*_codec_ids(specs[i])))
    return b"".join(parts)


def _check_finite(name: str, x: Tensor) -> None:
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"{name}: delta has NaN or Inf values")


def pack_many(tensors: list[Tensor], group: int) -> tuple[list[memoryview], Tensor]:
    """The sign bytes of each tensor (any shape, read flat as float32) and the scales of all
    (sum_i G_i,) float32 on the CPU, the same bytes on every path.

    The pack kernel runs where `kernels.active_for` says so (CUDA tensors with Triton); it
    reproduces the CPU path bit for bit. Anywhere else the tensors are packed on the CPU, into
    one byte buffer that the returned views share: the torch path on a GPU sums |x| in
    another order, so its scales could differ from the CPU's in the last bit, and a payload's
    bytes must not depend on the machine that made it.
    """
    on_cpu = all(t.is_cpu for t in tensors)
    if not on_cpu or kernels.active_for("cpu"):
        devices = {t.device for t in tensors}
        if len(devices) == 1 and kernels.can_pack(group) and kernels.active_for(devices.pop()):
            flats = [t.detach().reshape(-1).to(torch.float32).contiguous() for t in tensors]
            packed, scales = kernels.pack_many(flats, group)
            return [p.numpy().data for p in packed], scales
    bits, starts, scales = bitdelta.pack_concat(
        tensors if on_cpu else [t.cpu() for t in tensors], group
    )
    view = bits.data
    signs = [view[s : s + (t.numel() + 7) // 8] for s, t in zip(starts, tensors, strict=True)]
    return signs, scales


def _bitdelta_sections(
    names: list[str], tensors: list[Tensor], spec: CodecSpec
) -> list[bytes | memoryview]:
    """Scales and sign bytes of every tensor, in table order, from one `pack_many` pass.

    A NaN or Inf value makes its group's mean |x| non-finite, so the float32 scales reveal
    bad input without a separate pass over the values (as do finite values whose sum
    overflows float32). Past that check the scales are finite and not negative, so the
    largest stored one is infinite exactly when one overflowed the scale dtype.
    """
    group = spec.group_size
    bits, scales = pack_many(tensors, group)
    if not np.isfinite(scales.numpy()).all():
        for name, t in zip(names, tensors, strict=True):
            _check_finite(name, t)
        raise ValueError("a group's sum of |x| overflows float32; scale the delta down")
    stored = scales.to(codecs.SCALE_TORCH_DTYPES[spec.scale_dtype])
    if stored.dtype != scales.dtype and stored.numel() and not math.isfinite(float(stored.max())):
        raise ValueError(f"a scale overflows {spec.scale_dtype}; use scale_dtype='float32'")
    raw = stored.view(torch.uint8).numpy().data
    width = _SCALE_BYTES[spec.scale_dtype]
    sections: list[bytes | memoryview] = []
    start = 0
    for t, signs in zip(tensors, bits, strict=True):
        stop = start + width * -(-t.numel() // group)
        sections += (raw[start:stop], signs)
        start = stop
    return sections


def _codec_spec(codec_id: int, gran_id: int, group_size: int, scale_id: int) -> CodecSpec:
    """The `CodecSpec` of a header's (or a version 3 entry's) ids; raises `EnvelopeError`."""
    if codec_id not in _CODEC_NAMES:
        raise EnvelopeError(f"unknown codec id {codec_id}")
    if gran_id >= len(GRANULARITIES) or scale_id >= len(SCALE_DTYPES):
        raise EnvelopeError(f"unknown granularity id {gran_id} or scale dtype id {scale_id}")
    if group_size < 1:
        raise EnvelopeError("group size 0 in envelope header")
    try:
        return CodecSpec(
            _CODEC_NAMES[codec_id], group_size, GRANULARITIES[gran_id], SCALE_DTYPES[scale_id]
        )
    except ValueError as exc:
        raise EnvelopeError(f"invalid codec parameters: {exc}") from exc


def _parse_spec(payload: bytes, sha256: str | None = None) -> tuple[int, CodecSpec, int]:
    if len(payload) < _HEAD.size + _DIGEST:
        raise EnvelopeError(f"truncated envelope: {len(payload)} bytes is shorter than a header")
    magic, version, codec_id, gran_id, group_size, scale_id, count = _HEAD.unpack_from(payload)
    if magic != MAGIC:
        raise EnvelopeError(f"bad magic {magic!r}, expected {MAGIC!r}: not a zoo-gym delta")
    if version not in VERSIONS:
        raise EnvelopeError(
            f"unsupported envelope version {version}, this reader knows {', '.join(map(str, VERSIONS))}"
        )
    if payload[_HEAD.size - 7 : _HEAD.size - 4] != b"\0\0\0":
        raise EnvelopeError("reserved header bytes are not zero")
    spec = _codec_spec(codec_id, gran_id, group_size, scale_id)
    hashed = hashlib.sha256(memoryview(payload)[:-_DIGEST])
    if sha256 is not None:  # the whole payload's: the same pass, carried over the digest
        whole = hashed.copy()
        whole.update(memoryview(payload)[-_DIGEST:])
        if whole.hexdigest() != sha256:
            raise EnvelopeError(
                "SHA-256 of the envelope is not the one expected: it is corrupted or was replaced"
            )
    if hashed.digest() != payload[-_DIGEST:]:
        raise EnvelopeError("SHA-256 mismatch: the envelope is corrupted or was modified")
    return version, spec, count


def _inflated_table(payload: bytes, end: int) -> tuple[bytes, int]:
    """A version 2 envelope's per-tensor table, inflated (at most `MAX_TABLE_BYTES`), and
    where the sections start in `payload`."""
    start = _HEAD.size + _TABLE_LENGTH.size
    if start > end:
        raise EnvelopeError("truncated envelope: no room for the tensor table's length")
    (length,) = _TABLE_LENGTH.unpack_from(payload, _HEAD.size)
    if start + length > end:
        raise EnvelopeError("truncated envelope: the deflated tensor table runs past the end")
    inflater = zlib.decompressobj()
    try:
        table = inflater.decompress(payload[start : start + length], MAX_TABLE_BYTES)
    except zlib.error as exc:
        raise EnvelopeError(f"the tensor table does not inflate: {exc}") from exc
    if not inflater.eof or inflater.unconsumed_tail or inflater.unused_data:
        raise EnvelopeError(
            f"the tensor table does not inflate to one zlib stream of at most {MAX_TABLE_BYTES} bytes"
        )
    return table, start + length


def _parse_table(
    payload: bytes, count: int, end: int, start: int = _HEAD.size, *, own: bool = False
) -> tuple[Layout, list[CodecSpec | None], int]:
    """The layout, each entry's own codec (version 3, `own`; None otherwise) and where the
    table ends in `payload`."""
    offset = start
    entry_min = _NAME.size + _DTYPE_NDIM.size + (_OWN_CODEC.size if own else 0)
    if count > (end - offset) // entry_min:
        raise EnvelopeError(f"tensor count {count} does not fit in {len(payload)} bytes")
    layout: list[TensorSpec] = []
    specs: list[CodecSpec | None] = []
    try:
        for _ in range(count):
            ts, offset = _parse_entry(payload, offset, end)
            if layout and ts.name <= layout[-1].name:
                raise EnvelopeError(f"tensor names not strictly increasing at {ts.name!r}")
            layout.append(ts)
            if own:
                specs.append(_codec_spec(*_OWN_CODEC.unpack_from(payload, offset)))
                offset += _OWN_CODEC.size
            else:
                specs.append(None)
    except struct.error as exc:
        raise EnvelopeError(f"truncated envelope: tensor table runs past the end ({exc})") from exc
    except UnicodeDecodeError as exc:
        raise EnvelopeError("tensor name is not valid UTF-8") from exc
    return tuple(layout), specs, offset


def _parse_entry(payload: bytes, offset: int, end: int) -> tuple[TensorSpec, int]:
    """One entry's name, dtype and shape from `offset` on, and where they end."""
    (name_len,) = _NAME.unpack_from(payload, offset)
    offset += _NAME.size
    if offset + name_len > end:
        raise EnvelopeError("truncated envelope: tensor name runs past the end")
    name = payload[offset : offset + name_len].decode("utf-8")
    offset += name_len
    dtype_id, ndim = _DTYPE_NDIM.unpack_from(payload, offset)
    offset += _DTYPE_NDIM.size
    if dtype_id not in _DTYPE_NAMES or ndim > MAX_NDIM:
        raise EnvelopeError(f"{name}: unknown dtype id {dtype_id} or {ndim} dimensions")
    if offset + 8 * ndim > end:
        raise EnvelopeError("truncated envelope: tensor shape runs past the end")
    shape = struct.unpack_from(f"<{ndim}Q", payload, offset)
    return TensorSpec(name, tuple(shape), _DTYPE_NAMES[dtype_id]), offset + 8 * ndim


def inspect_envelope(
    payload: bytes, *, max_elements: int, sha256: str | None = None
) -> EnvelopeHeader:
    """Validate an envelope's header, hash and sizes without decoding any values; with
    `sha256` (hex), the whole payload must have that SHA-256 too (one a record gives).

    Raises `EnvelopeError` (one line) for bad magic, an unknown version or codec, a hash
    mismatch, a truncated or oversized payload, or more than `max_elements` values in total.
    Cost: one SHA-256 pass over the payload (both hashes) and a walk of the tensor table.
    """
    if not isinstance(payload, bytes | bytearray | memoryview):
        raise EnvelopeError(f"payload must be bytes, got {type(payload).__name__}")
    payload = bytes(payload)
    version, spec, count = _parse_spec(payload, sha256)
    end = len(payload) - _DIGEST
    if version == 1:
        layout, specs, offset = _parse_table(payload, count, end)
    else:
        table, offset = _inflated_table(payload, end)
        own = version == MIXED_VERSION
        layout, specs, used = _parse_table(table, count, len(table), start=0, own=own)
        if used != len(table):
            raise EnvelopeError("the inflated tensor table has bytes after its last entry")
    total = sum(ts.numel for ts in layout)
    if total > max_elements:
        raise EnvelopeError(
            f"envelope declares {total} values, more than max_elements={max_elements}"
        )
    header_nbytes = offset
    sections = []
    for ts, own_spec in zip(layout, specs, strict=True):
        section = _section(ts, spec if own_spec is None else own_spec, offset)
        sections.append(section)
        offset = section.data_offset + section.data_nbytes
    if offset != end:
        kind = "truncated" if offset > end else "oversized"
        raise EnvelopeError(
            f"{kind} envelope: the tensor table needs {offset + _DIGEST} bytes, got {len(payload)}"
        )
    return EnvelopeHeader(
        version,
        spec,
        layout,
        tuple(sections),
        total,
        header_nbytes,
        end - header_nbytes,
        len(payload),
    )


def _section(ts: TensorSpec, spec: CodecSpec, offset: int) -> TensorSection:
    """Where the scales and values of tensor `ts` in codec `spec` lie, from `offset` on."""
    group = group_length(spec, ts.shape)
    groups = n_groups(ts.numel, group) if spec.scaled else 0
    scales = groups * _SCALE_BYTES[spec.scale_dtype] if spec.scaled else 0
    data = codecs.data_nbytes(spec.codec, ts.numel)
    return TensorSection(ts, spec, group, groups, offset, scales, offset + scales, data)


def _frombuffer(payload: bytes, offset: int, nbytes: int, dtype: torch.dtype) -> Tensor:
    """A read-only tensor view of `payload[offset : offset + nbytes]`."""
    if nbytes == 0:
        return torch.empty(0, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch warns that bytes are read-only
        raw = torch.frombuffer(payload, dtype=torch.uint8, count=nbytes, offset=offset)
    return raw.view(dtype)


def section_tensors(payload: bytes, section: TensorSection) -> tuple[Tensor, Tensor]:
    """(scales (G,) float32, packed bytes (k,) uint8) of one tensor in its codec; raises on
    bad scales."""
    spec = section.codec_spec
    scale_dtype = codecs.SCALE_TORCH_DTYPES[spec.scale_dtype]
    scales = _frombuffer(payload, section.scales_offset, section.scales_nbytes, scale_dtype).float()
    if spec.scaled:
        bound = scales * codecs.LEVELS[spec.codec]
        if not bool(torch.isfinite(bound).all()):
            raise EnvelopeError(f"{section.spec.name}: NaN, Inf or overflowing scale")
        if bool((scales < 0).any()):
            raise EnvelopeError(f"{section.spec.name}: negative scale")
    data = _frombuffer(payload, section.data_offset, section.data_nbytes, torch.uint8)
    return scales, data


def unpacks_together(header: EnvelopeHeader) -> bool:
    """Whether the whole payload unpacks in one `unpack_bitdelta` call (BitDelta, one group
    size and scale dtype for every tensor). A version 3 envelope with other codecs among its
    tensors does not: its readers decode a tensor at a time, BitDelta tensors through the
    unpack kernel where it runs and the others through torch."""
    return header.codec == "bitdelta" and header.spec.granularity == "group" and not header.mixed


def unpack_bitdelta(
    payload: bytes,
    header: EnvelopeHeader,
    out: Tensor,
    *,
    weight: float | None = None,
    triton: bool = False,
) -> None:
    """Write (or, with `weight`, add `weight` times) every tensor of a BitDelta payload into the
    flat `out`, through `bitdelta.unpack_many` or, with `triton`, the unpack kernel (signs
    and scales copied to `out`'s device once); see `unpacks_together`."""
    packed, scales = bitdelta_parts(payload, header)
    ns = [section.spec.numel for section in header.sections]
    unpack_many = kernels.unpack_many if triton else bitdelta.unpack_many
    unpack_many(packed, scales, ns, header.spec.group_size, out, weight=weight)


def bitdelta_parts(payload: bytes, header: EnvelopeHeader) -> tuple[list[Tensor], Tensor]:
    """(packed signs per tensor, all scales concatenated as float32) of a BitDelta envelope.

    Validates every scale (finite, not negative) in one pass and the zero padding of each
    tensor's last byte; raises `EnvelopeError` naming the first bad tensor, and ValueError
    unless `unpacks_together(header)`.
    """
    if not unpacks_together(header):
        raise ValueError("bitdelta_parts needs an envelope of BitDelta tensors of one group size")
    raw = _frombuffer(payload, 0, len(payload), torch.uint8)
    scale_dtype = codecs.SCALE_TORCH_DTYPES[header.spec.scale_dtype]
    pieces = [raw[s.scales_offset : s.scales_offset + s.scales_nbytes] for s in header.sections]
    scales = (torch.cat(pieces) if pieces else raw[:0]).view(scale_dtype).float()
    bad = ~torch.isfinite(scales) | (scales < 0)
    if bool(bad.any()):
        first = int(bad.nonzero()[0, 0])
        for section in header.sections:
            if first < section.n_groups:
                raise EnvelopeError(f"{section.spec.name}: NaN, Inf or negative scale")
            first -= section.n_groups
    packed = []
    for section in header.sections:
        bits = raw[section.data_offset : section.data_offset + section.data_nbytes]
        codecs.check_padding(bits, section.spec.numel, section.spec.name)
        packed.append(bits)
    return packed, scales


def check_layout(header: EnvelopeHeader, layout: Layout) -> None:
    """Raise `EnvelopeError` unless the envelope holds exactly `layout`'s names and shapes."""
    got = [(ts.name, ts.shape) for ts in header.layout]
    want = [(ts.name, tuple(ts.shape)) for ts in layout]
    if got != want:
        diff = next(
            (f"{g} != {w}" for g, w in zip(got, want, strict=False) if g != w),
            f"{len(got)} tensors, expected {len(want)}",
        )
        raise EnvelopeError(f"envelope tensors differ from the layout: {diff}")


def use_triton(out: Tensor, backend: str) -> bool:
    """Backend choice: ``"auto"`` runs the Triton kernels where `kernels.active_for(out)` says
    so (CUDA tensors when Triton is installed) and the torch path otherwise; ``"torch"`` and
    ``"triton"`` force one."""
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"unknown backend {backend!r}; choose 'auto', 'torch' or 'triton'")
    if backend == "auto":
        return kernels.active_for(out)
    return backend == "triton"


def decode_into(
    payload: bytes, out: Tensor, layout: Layout, *, max_elements: int, backend: str = "auto"
) -> None:
    """Decode into `out` (numel(layout),) float32, tensors concatenated in layout order.

    Writes straight into `out` (for instance one row of an (n, d) buffer), one tensor at a
    time, without a second full-size float copy. Raises `EnvelopeError` when the payload is
    invalid or its tensors (names and shapes) differ from `layout`; ValueError when `out`
    has the wrong shape or dtype.
    """
    d = sum(ts.numel for ts in layout)
    if out.dtype != torch.float32 or tuple(out.shape) != (d,):
        raise ValueError(f"out must be float32 of shape ({d},), got {out.dtype} {tuple(out.shape)}")
    payload = bytes(payload) if isinstance(payload, bytearray | memoryview) else payload
    header = inspect_envelope(payload, max_elements=max_elements)
    check_layout(header, layout)
    triton = use_triton(out, backend)
    if unpacks_together(header):
        unpack_bitdelta(payload, header, out, triton=triton)
        return
    offset = 0
    for section in header.sections:
        n = section.spec.numel
        scales, data = section_tensors(payload, section)
        target = out[offset : offset + n]
        codecs.decode_tensor(section.codec, scales, data, section.group, target, triton=triton)
        offset += n


def decode(payload: bytes, *, max_elements: int, device: torch.device | str | None = None) -> Delta:
    """Decode an envelope into float32 tensors on `device` (the CPU when None), one
    allocation per tensor.

    Where `kernels.active_for(device)` (CUDA with Triton) BitDelta signs and scales go to the
    device in one copy each and the unpack kernel writes the values there; elsewhere the torch
    path decodes. Both give the same values. Raises `EnvelopeError` (one line) for any
    invalid payload, before allocating anything when declared sizes disagree with the byte
    length or exceed `max_elements`.
    """
    target = torch.device("cpu" if device is None else device)
    triton = kernels.active_for(target)
    payload = bytes(payload) if isinstance(payload, bytearray | memoryview) else payload
    header = inspect_envelope(payload, max_elements=max_elements)
    delta: Delta = {}
    if unpacks_together(header) and (triton or target.type == "cpu"):  # checked once
        packed, scales = bitdelta_parts(payload, header)
        for section in header.sections:
            delta[section.spec.name] = torch.empty(
                section.spec.shape, dtype=torch.float32, device=target
            )
        outs = [t.view(-1) for t in delta.values()]
        if triton:
            kernels.unpack_each(packed, scales, header.spec.group_size, outs)
            return delta
        first = 0
        for section, bits, out in zip(header.sections, packed, outs, strict=True):
            group_scales = scales[first : first + section.n_groups]
            bitdelta.unpack_many([bits], group_scales, [out.numel()], header.spec.group_size, out)
            first += section.n_groups
        return delta
    for section in header.sections:
        scales, data = section_tensors(payload, section)
        out = torch.empty(section.spec.shape, dtype=torch.float32, device=target)
        codecs.decode_tensor(
            section.codec, scales, data, section.group, out.view(-1), triton=triton
        )
        delta[section.spec.name] = out
    return delta
