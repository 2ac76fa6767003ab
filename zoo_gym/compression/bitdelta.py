"""BitDelta sign packing: the torch reference (and CPU path) of the Triton kernels.

BitDelta [Liu et al., 2024, "BitDelta: Your Fine-Tune May Only Be Worth One Bit"] stores a
delta as ``scale * sign(delta)``. For a group of values x (n,) the L2-optimal scale of a sign
quantiser is ``argmin_a ||x - a sign(x)||^2 = mean |x|``.

Bit layout (shared with `zoo_gym.compression.kernels`): value ``8i + j`` of a tensor is bit
``7 - j`` of byte ``i`` (most significant bit first, as ``numpy.packbits``); the bit is 1 when
the value is ``>= 0`` (so 0 and -0.0 decode to ``+scale``) and 0 when it is negative. A
tensor of n values takes ``ceil(n / 8)`` bytes; unused low bits of the last byte are 0.
Groups are ``group`` consecutive values of the flattened tensor; the last may be partial.

CPU packing (`pack_concat`). For a group that is a multiple of 8 up to MAX_PACK_GROUP, one
compiled pass (the C extension `zoo_gym.compression._bitpack`, built from `_bitpack.c` where a
C compiler was present) reads each tensor once, setting each value's sign bit and adding |x|
into its group's float32 sum in exactly the order of ``torch.sum`` over a contiguous float32
row (see `zoo_gym.compression.kernels`), so its bytes are those of the numpy path below.
Where the extension was not built, for any other group, or after ``use_compiled(False)``, the
numpy path packs: chunks of the padded concatenation with ``numpy.abs``,
``numpy.greater_equal`` and ``numpy.packbits``, and the sums with one grouped ``torch.sum``.

The torch path avoids per-bit passes with two 64-bit multiplications: eight 0/1 bytes read as
one little-endian int64 ``v`` gather into the top byte of ``v * 0x8040201008040201``, and a
byte ``p`` spreads back into eight 0/1 bytes as ``((p * 0x8040201008040201) >> 7) & 0x01..01``
(the shifted copies of the operand never overlap, so no carries disturb the bits).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence

import numpy as np
import torch
from numpy.typing import NDArray
from torch import Tensor

from zoo_gym.compression.kernels import MAX_PACK_GROUP
from zoo_gym.core.extension import Extension

_MAGIC = 0x8040201008040201 - (1 << 64)  # the constant as a signed int64
_LOW_BITS = 0x0101010101010101
_CHUNK = 1 << 18  # values per chunk on CPU
_PACK_CHUNK = 1 << 17  # values per chunk when packing: measured faster than 1 << 16 and 1 << 18
_SHORT = 8192  # pieces shorter than this on average are gathered before packing
_SIGN_TABLE = torch.from_numpy(
    np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1).astype(np.float32) * 2 - 1
)  # (256, 8): row p holds +-1 for the eight bits of byte p, most significant first
_SIGN_TABLE_NP = _SIGN_TABLE.numpy()
_ZERO = np.float32(0.0)  # compared against without a conversion per call

_Segment = tuple[int, int, int, int]  # (tensor, start, length, padded), see `_segments`


_COMPILED = Extension("zoo_gym.compression._bitpack")


def compiled_available() -> bool:
    """Whether the compiled pack (`zoo_gym/compression/_bitpack.c`) was built and imports."""
    return _COMPILED.available


def use_compiled(enabled: bool) -> bool:
    """Pack on the CPU through the compiled pass when `enabled` (and it was built), through the
    numpy path otherwise; both give the same bytes. Returns the previous setting."""
    return _COMPILED.use(enabled)


def gather_rows(
    sources: Sequence[NDArray[np.uint8]], starts: NDArray[np.int64], out: NDArray[np.uint8]
) -> None:
    """Copy bytes `starts[i]` .. `starts[i] + c - 1` of `sources[i]` into row i of `out`
    `(n, c)` uint8: in one compiled call where built, row by row otherwise."""
    module = _COMPILED.module if _COMPILED.enabled else None
    if module is not None:
        module.gather(sources, starts, out.shape[1], out)
        return
    count = out.shape[1]
    for i, (source, at) in enumerate(zip(sources, starts.tolist(), strict=True)):
        out[i] = source[at : at + count]


def _compiled_for(group: int) -> bool:
    """Whether `pack_concat` runs the compiled pass for `group`: a multiple of 8 up to
    MAX_PACK_GROUP, the groups the Triton pack kernel takes."""
    return _COMPILED.enabled and group % 8 == 0 and group <= MAX_PACK_GROUP


def pack_signs(x: Tensor) -> Tensor:
    """Pack ``x >= 0`` of a flat tensor `x` (n,) into bytes (ceil(n / 8),) uint8."""
    n = x.numel()
    m = (n + 7) // 8
    if m == 0:
        return torch.empty(0, dtype=torch.uint8, device=x.device)
    if n % 8:
        bits = torch.zeros(m * 8, dtype=torch.bool, device=x.device)
    else:
        bits = torch.empty(m * 8, dtype=torch.bool, device=x.device)
    torch.ge(x.reshape(-1), 0, out=bits[:n])
    gathered = bits.view(torch.int64) * _MAGIC  # (m,)
    out = torch.empty(m, dtype=torch.uint8, device=x.device)
    return out.copy_(gathered.view(torch.uint8).view(m, 8)[:, 7])


def unpack_signs(packed: Tensor, n: int) -> Tensor:
    """Unpack bytes (ceil(n / 8),) uint8 into booleans (n,): True where the value was >= 0."""
    if packed.numel() == 0:
        return torch.empty(0, dtype=torch.bool, device=packed.device)
    spread = torch.empty(packed.numel(), dtype=torch.int64, device=packed.device)
    spread.copy_(packed.reshape(-1)).mul_(_MAGIC).bitwise_right_shift_(7).bitwise_and_(_LOW_BITS)
    return spread.view(torch.uint8)[:n].view(torch.bool)


def sign_values(packed: Tensor) -> Tensor:
    """The +-1.0 float32 values (8 m,) of the sign bits in bytes `packed` (m,) uint8."""
    table = _SIGN_TABLE.to(packed.device)
    return table.index_select(0, packed.reshape(-1).long()).view(-1)


def sign_values_into(packed: NDArray[np.uint8], out: NDArray[np.float32]) -> None:
    """Write the +-1.0 values of the sign bytes `packed` (..., m) uint8 into `out`
    (..., m, 8) float32 (any strides), one row of `_SIGN_TABLE` per byte."""
    np.take(_SIGN_TABLE_NP, packed, axis=0, out=out, mode="clip")


def group_reduce(x: Tensor, group: int, *, ord: float) -> Tensor:
    """Per-group ``mean |x|`` (``ord=1``) or ``max |x|`` (``ord=inf``) of `x` (n,) -> (G,) float32."""
    n = x.numel()
    full, tail = divmod(n, group)
    parts = []
    if full:
        norms = torch.linalg.vector_norm(x[: full * group].view(full, group), ord=ord, dim=1)
        parts.append(norms / group if ord == 1 else norms)
    if tail:
        norm = torch.linalg.vector_norm(x[full * group :], ord=ord).reshape(1)
        parts.append(norm / tail if ord == 1 else norm)
    if not parts:
        return torch.empty(0, dtype=torch.float32, device=x.device)
    return (parts[0] if len(parts) == 1 else torch.cat(parts)).float()


def _chunk_len(group: int, chunk: int = _CHUNK) -> int:
    """Values per chunk of the CPU path: whole groups and whole bytes, about `chunk` values."""
    unit = math.lcm(group, 8)
    return unit * max(1, chunk // unit)


def _use_numpy(t: Tensor, group: int) -> bool:
    return t.device.type == "cpu" and math.lcm(group, 8) <= _CHUNK


def pack(x: Tensor, group: int) -> tuple[Tensor, Tensor]:
    """BitDelta-compress `x` (n,) float32: (packed signs (ceil(n/8),) uint8, scales (G,) float32).

    ``scale_k = mean |x|`` over group k, the L2-optimal scale for sign quantisation
    (Liu et al., 2024). One tensor of `pack_many`.
    """
    packed, scales = pack_many([x], group)
    return packed[0], scales


def _signed(bits: Tensor, scales: Tensor, group: int, out: Tensor) -> Tensor:
    """Write ``where(bits, s, -s)`` into `out` (n,), s the scale of each value's group."""
    n = out.numel()
    full, tail = divmod(n, group)
    if full:
        s = scales[:full, None]
        head = out[: full * group].view(full, group)
        torch.where(bits[: full * group].view(full, group), s, -s, out=head)
    if tail:
        s = scales[full : full + 1]
        torch.where(bits[full * group :], s, -s, out=out[full * group :])
    return out


def _segments(ns: Sequence[int], group: int) -> Iterator[list[_Segment]]:
    """Split tensors of `ns` values into chunks of (tensor, start, length, padded) segments.

    A chunk holds at most `_chunk_len(group)` values. A tensor longer than that spans several
    chunks; short tensors share one. Each segment starts at a multiple of lcm(group, 8) within
    its tensor and is padded to one, so whole groups and whole bytes never straddle segments.
    """
    unit = math.lcm(group, 8)
    limit = _chunk_len(group)
    chunk: list[_Segment] = []
    used = 0
    for i, n in enumerate(ns):
        for start in range(0, n, limit):
            length = min(limit, n - start)
            padded = -(-length // unit) * unit
            if chunk and used + padded > limit:
                yield chunk
                chunk, used = [], 0
            chunk.append((i, start, length, padded))
            used += padded
    if chunk:
        yield chunk


def _group_offsets(ns: Sequence[int], group: int) -> list[int]:
    """Index of each tensor's first scale in the concatenated scales."""
    offsets = [0]
    for n in ns:
        offsets.append(offsets[-1] + -(-n // group))
    return offsets


def _aligned(ns: Sequence[int], group: int) -> bool:
    """Whether an update of tensors of `ns` values packs as one flat vector: it fits one chunk
    and every tensor holds whole groups and whole bytes."""
    unit = math.lcm(group, 8)
    return sum(ns) <= _chunk_len(group) and all(n % unit == 0 for n in ns)


def _pack_aligned(
    xs: Sequence[Tensor], ns: list[int], group: int
) -> tuple[NDArray[np.uint8], list[int], Tensor]:
    """`pack_concat` of a short update whose tensors all hold whole groups and whole bytes:
    concatenated, such tensors pack exactly as they do one by one, in a few calls."""
    flat = torch.cat([x.detach().reshape(-1) for x in xs]).float()  # (sum n_i,)
    signs = np.empty(flat.numel(), dtype=np.bool_)
    np.greater_equal(flat.numpy(), _ZERO, out=signs)
    scales = torch.sum(flat.abs_().view(-1, group), 1).div_(group)
    starts = list(itertools.accumulate((n // 8 for n in ns[:-1]), initial=0))
    return np.packbits(signs), starts, scales


def _buffer_len(ns: Sequence[int], group: int) -> int:
    """Values in the chunk buffers: one chunk, or fewer when the whole update is smaller."""
    unit = math.lcm(group, 8)
    return min(_chunk_len(group), sum(-(-n // unit) * unit for n in ns))


_Piece = tuple[int, int, int, int]  # (tensor, start, stop, zeros after), see `_pack_plan`


def _pack_plan(ns: Sequence[int], unit: int, limit: int) -> Iterator[tuple[int, int, list[_Piece]]]:
    """Cut the padded concatenation of tensors of `ns` values into chunks of at most `limit`.

    Tensor i is zero-padded to a multiple of `unit` = lcm(group, 8) values and the padded tensors
    are laid end to end; `limit` is a multiple of `unit`, so no group and no byte straddles two
    chunks. Yields (offset in the padded concatenation, size, pieces), each piece being values
    ``start:stop`` of tensor i followed by that many zeros.
    """
    pieces: list[_Piece] = []
    offset = used = 0
    for i, n in enumerate(ns):
        padded = -(-n // unit) * unit
        start = 0
        while start < padded:
            take = min(limit - used, padded - start)
            stop = min(start + take, n)
            pieces.append((i, start, stop, take - (stop - start)))
            used += take
            start += take
            if used == limit:
                yield offset, used, pieces
                offset, used, pieces = offset + used, 0, []
    if pieces:
        yield offset, used, pieces


def _flat_array(x: Tensor) -> NDArray[np.float32]:
    """The values of a CPU tensor `x` as a flat float32 array (a view when `x` is contiguous
    float32; the cheapest calls, as they run once per tensor)."""
    t = x.detach() if x.requires_grad else x
    return (t if t.dtype == torch.float32 else t.float()).numpy().ravel()


def _chunk_values(
    pieces: list[_Piece],
    flats: Sequence[NDArray[np.float32]],
    signs: NDArray[np.bool_],
    absbuf: NDArray[np.float32],
) -> None:
    """Write ``x >= 0`` and ``|x|`` of a chunk's `pieces` into `signs` and `absbuf` (the
    chunk's size); a padded zero gets ``|x| = 0`` and a cleared sign bit.

    Long pieces are read in place, ``|x|`` first: that pass streams the values from memory
    and the sign pass then finds them in cache. Many short pieces are first gathered into
    `absbuf` by one ``numpy.concatenate``, which costs less than a few calls per piece.
    """
    if len(pieces) > 2 and absbuf.size < _SHORT * len(pieces):
        _gather_values(pieces, flats, signs, absbuf)
        return
    at = 0
    for i, start, stop, pad in pieces:
        part = flats[i][start:stop]
        end = at + stop - start
        np.abs(part, out=absbuf[at:end])
        np.greater_equal(part, _ZERO, out=signs[at:end])
        if pad:
            absbuf[end : end + pad] = 0.0
            signs[end : end + pad] = False
        at = end + pad


def _gather_values(
    pieces: list[_Piece],
    flats: Sequence[NDArray[np.float32]],
    signs: NDArray[np.bool_],
    absbuf: NDArray[np.float32],
) -> None:
    """`_chunk_values` of many short pieces: gathered with their zeros, then made absolute."""
    parts: list[NDArray[np.float32]] = []
    zeros = np.zeros(max(pad for *_, pad in pieces), dtype=np.float32)
    for i, start, stop, pad in pieces:
        parts.append(flats[i][start:stop])
        if pad:
            parts.append(zeros[:pad])
    np.concatenate(parts, out=absbuf)
    np.greater_equal(absbuf, _ZERO, out=signs)
    np.abs(absbuf, out=absbuf)
    at = 0
    for _, start, stop, pad in pieces:
        at += stop - start
        if pad:
            signs[at : at + pad] = False
            at += pad


def _pack_chunked(
    xs: Sequence[Tensor], ns: list[int], group: int
) -> tuple[NDArray[np.uint8], list[int], Tensor]:
    """`pack_concat` on CPU: the padded concatenation of `_pack_plan`, chunk by chunk.

    Each chunk's sign bytes and group sums go straight to their place in one byte buffer and
    one sums buffer laid out like the padded concatenation; tensor i's bytes are the first
    ceil(n_i / 8) of its padded bytes. Afterwards each sum is divided by its group's real
    length and the sums of whole-padding groups are left out of the scales.
    """
    unit = math.lcm(group, 8)
    limit = _chunk_len(group, _PACK_CHUNK)
    flats = [_flat_array(x) for x in xs]
    padded = [-(-n // unit) * unit for n in ns]
    starts = list(itertools.accumulate(padded, initial=0))
    total = starts.pop()
    bits = np.empty(total // 8, dtype=np.uint8)
    sums = torch.empty(total // group, dtype=torch.float32)
    size = min(limit, total)
    signs = np.empty(size, dtype=np.bool_)
    absbuf = torch.empty(size, dtype=torch.float32)
    for offset, size, pieces in _pack_plan(ns, unit, limit):
        _chunk_values(pieces, flats, signs[:size], absbuf.numpy()[:size])
        bits[offset // 8 : (offset + size) // 8] = np.packbits(signs[:size])
        torch.sum(
            absbuf[:size].view(-1, group), 1, out=sums[offset // group : (offset + size) // group]
        )
    if total == sum(ns):  # no padding: every group is whole
        return bits, [s // 8 for s in starts], sums.div_(float(group))
    return bits, [s // 8 for s in starts], _group_means(sums, ns, padded, starts, group)


def _pack_fused(
    xs: Sequence[Tensor], ns: list[int], group: int
) -> tuple[NDArray[np.uint8], list[int], Tensor]:
    """`pack_concat` through the compiled pass, tensor by tensor: one read of each tensor's
    values writes its sign bytes and its group sums of |x| straight into the one byte buffer
    (tensors' bytes end to end) and the one sums buffer; then each sum is divided by its
    group's length."""
    assert _COMPILED.module is not None
    pack = _COMPILED.module.pack
    starts = list(itertools.accumulate(((n + 7) // 8 for n in ns), initial=0))
    firsts = list(itertools.accumulate((-(-n // group) for n in ns), initial=0))
    bits = np.empty(starts[-1], dtype=np.uint8)
    sums = torch.empty(firsts[-1], dtype=torch.float32)
    sums_np = sums.numpy()
    for x, start, first in zip(xs, starts, firsts, strict=False):
        pack(_flat_array(x), group, bits, start, sums_np, first)
    starts.pop()
    tails = [(first - 1, n % group) for first, n in zip(firsts[1:], ns, strict=True) if n % group]
    if not tails:
        return bits, starts, sums.div_(float(group))
    counts = torch.full_like(sums, float(group))
    counts[[k for k, _ in tails]] = torch.tensor([float(t) for _, t in tails])
    return bits, starts, sums.div_(counts)


def _group_means(
    sums: Tensor, ns: Sequence[int], padded: Sequence[int], starts: Sequence[int], group: int
) -> Tensor:
    """Scales (sum_i ceil(n_i / group),) from the `sums` of the padded concatenation: each sum
    divided by its group's real length, whole-padding groups left out."""
    partial = [(s + n) // group for s, n in zip(starts, ns, strict=False) if n % group]
    if partial:
        counts = torch.full_like(sums, float(group))
        counts[partial] = torch.tensor([float(n % group) for n in ns if n % group])
        sums.div_(counts)
    else:
        sums.div_(float(group))
    real = [-(-n // group) for n in ns]
    if all(p // group == k for p, k in zip(padded, real, strict=True)):
        return sums
    return torch.cat(
        [sums[s // group : s // group + k] for s, k in zip(starts, real, strict=False)]
    )


def _pack_torch(xs: Sequence[Tensor], group: int) -> tuple[list[Tensor], Tensor]:
    """`pack_many` with torch operations only, tensor by tensor: any device, any group size."""
    signs = [pack_signs(x) for x in xs]
    return signs, torch.cat([group_reduce(x.reshape(-1), group, ord=1) for x in xs])


def pack_many(xs: Sequence[Tensor], group: int) -> tuple[list[Tensor], Tensor]:
    """BitDelta-compress flat float32 tensors `xs` (n_i,) that share one group size.

    Returns (packed signs per tensor (ceil(n_i / 8),) uint8, the scales of all tensors
    concatenated (sum_i ceil(n_i / group),) float32), each equal to `pack` of that tensor.
    ``scale_k = mean |x|`` over group k (Liu et al., 2024). On CPU the packed tensors are
    views of the one buffer of `pack_concat`; elsewhere the torch path packs tensor by tensor.
    """
    if not xs:
        return [], torch.empty(0, dtype=torch.float32)
    if math.lcm(group, 8) > _CHUNK or any(not x.is_cpu for x in xs):
        return _pack_torch(xs, group)
    bits, starts, scales = pack_concat(xs, group)
    flat = torch.from_numpy(bits)
    sizes = [(x.numel() + 7) // 8 for x in xs]
    if sum(sizes) == flat.numel():  # no padding: the tensors' bytes lie end to end
        return list(torch.split(flat, sizes)), scales
    return [flat[s : s + k] for s, k in zip(starts, sizes, strict=True)], scales


def pack_concat(xs: Sequence[Tensor], group: int) -> tuple[NDArray[np.uint8], list[int], Tensor]:
    """`pack_many` of CPU tensors `xs` (any shape, read flat as float32) into one byte buffer.

    Returns (bytes (B,) uint8, where each tensor's ceil(n_i / 8) bytes begin in it, the
    scales of all tensors concatenated (sum_i ceil(n_i / group),) float32).

    With the compiled pass (see the module docstring) each tensor is read once and its bytes
    and group sums are written straight into the result, tensor after tensor; a partial last
    group is summed as if zero-padded. On the numpy path the values stream through cache-sized
    chunks of the tensors laid end to end, each zero-padded to a multiple of lcm(group, 8)
    values (a padded zero adds nothing to a group's sum of |x| and its sign bit is cleared),
    so one ``numpy.packbits`` and one grouped sum serve many tensors and write straight into
    the result; extra memory is two chunk buffers (~0.6 MiB). Both give the same bytes.
    """
    if math.lcm(group, 8) > _CHUNK:  # a group larger than a chunk: tensor by tensor
        packed, scales = _pack_torch([x.detach().reshape(-1).float() for x in xs], group)
        sizes = [p.numel() for p in packed]
        bits = torch.cat(packed).numpy() if packed else np.empty(0, dtype=np.uint8)
        return bits, list(itertools.accumulate(sizes[:-1], initial=0)), scales
    ns = [x.numel() for x in xs]
    if not ns:
        return np.empty(0, dtype=np.uint8), [], torch.empty(0, dtype=torch.float32)
    if _compiled_for(group):
        return _pack_fused(xs, ns, group)
    if _aligned(ns, group):
        return _pack_aligned(xs, ns, group)
    return _pack_chunked(xs, ns, group)


def _store(target: Tensor, values: Tensor, *, add: bool) -> None:
    """``target += values`` when `add`, else ``target = values``."""
    if add:
        target.add_(values)
    else:
        target.copy_(values)


def _decode_bytes(index: Tensor, scales: Tensor, group: int, dest: Tensor) -> None:
    """Write ``+-scale`` into `dest` (8 m,) from bytes `index` (m,) int64 and `scales` (8 m / group,):
    the +-1 patterns of the bytes from `_SIGN_TABLE`, each group then scaled in place."""
    torch.index_select(_SIGN_TABLE, 0, index, out=dest.view(-1, 8))
    dest.view(-1, group).mul_(scales[:, None])


def _unpack_torch(
    packed: Sequence[Tensor],
    scales: Tensor,
    ns: Sequence[int],
    group: int,
    out: Tensor,
    *,
    add: bool,
) -> None:
    """`unpack_many` with torch operations only, tensor by tensor: any device, any group size."""
    offset, goff = 0, _group_offsets(ns, group)
    for i, n in enumerate(ns):
        target = out[offset : offset + n]
        bits = unpack_signs(packed[i], n)
        signed = _signed(bits, scales[goff[i] : goff[i + 1]], group, torch.empty_like(target))
        _store(target, signed, add=add)
        offset += n


def _unpack_aligned(
    packed: Sequence[Tensor], scales: Tensor, group: int, out: Tensor, *, add: bool
) -> None:
    """`unpack_many` of a short update whose tensors all hold whole groups and whole bytes: their
    bytes concatenated decode as one flat vector."""
    index = torch.cat(list(packed)).long() if packed else torch.empty(0, dtype=torch.long)
    dest = torch.empty_like(out) if add else out
    _decode_bytes(index, scales, group, dest)
    if add:
        out.add_(dest)


def _copy_out(
    chunk: list[_Segment], decoded: Tensor, starts: Sequence[int], out: Tensor, *, add: bool
) -> None:
    """Store the values of each segment of a `decoded` chunk, padding left out, at its place in
    `out`, where tensor i begins at `starts[i]`."""
    off = 0
    for i, start, length, padded in chunk:
        at = starts[i] + start
        _store(out[at : at + length], decoded[off : off + length], add=add)
        off += padded


def _gather_chunk(
    chunk: list[_Segment],
    packed: Sequence[NDArray[np.uint8]],
    scales: NDArray[np.float32],
    goff: Sequence[int],
    group: int,
    bytebuf: NDArray[np.uint8],
    chunk_scales: NDArray[np.float32],
) -> int:
    """Copy each segment's bytes and scales into the chunk buffers `bytebuf` and `chunk_scales`,
    the mirror of `_scatter_chunk`; return the chunk's padded length."""
    off = 0
    for i, start, length, padded in chunk:
        nb, k = (length + 7) // 8, -(-length // group)
        bytebuf[off // 8 : off // 8 + nb] = packed[i][start // 8 : start // 8 + nb]
        g = goff[i] + start // group
        chunk_scales[off // group : off // group + k] = scales[g : g + k]
        off += padded
    return off


def _unpack_chunked(
    packed: Sequence[Tensor],
    scales: Tensor,
    ns: Sequence[int],
    group: int,
    out: Tensor,
    *,
    add: bool,
) -> None:
    """`unpack_many` on CPU, chunk by chunk of `_segments`. A chunk without padding decodes
    straight into `out`; otherwise it decodes into a buffer and each segment is copied out."""
    goff = _group_offsets(ns, group)
    starts = list(itertools.accumulate(ns, initial=0))
    scales_np = scales.contiguous().numpy()
    packed_np = [p.numpy() for p in packed]
    limit = _buffer_len(ns, group)
    step = torch.empty(limit, dtype=torch.float32)
    bytebuf = np.empty(limit // 8, dtype=np.uint8)
    chunk_scales = torch.empty(limit // group, dtype=torch.float32)
    chunk_scales_np = chunk_scales.numpy()
    for chunk in _segments(ns, group):
        size = _gather_chunk(chunk, packed_np, scales_np, goff, group, bytebuf, chunk_scales_np)
        direct = all(length == padded for _, _, length, padded in chunk)
        first = starts[chunk[0][0]] + chunk[0][1]
        dest = out[first : first + size] if direct and not add else step[:size]
        index = torch.from_numpy(bytebuf[: size // 8]).long()
        _decode_bytes(index, chunk_scales[: size // group], group, dest)
        if not direct:
            _copy_out(chunk, step, starts, out, add=add)
        elif add:
            out[first : first + size].add_(dest)


def unpack_many(
    packed: Sequence[Tensor],
    scales: Tensor,
    ns: Sequence[int],
    group: int,
    out: Tensor,
    *,
    weight: float | None = None,
) -> None:
    """Decode tensors laid end to end into `out` (sum_i n_i,) float32.

    `packed[i]` (ceil(n_i / 8),) uint8 and the concatenated `scales` (sum_i ceil(n_i / group),)
    are as returned by `pack_many`. ``weight=None`` writes ``out[i] = +-scale``; a float adds
    ``+-(weight * scale)`` (the product rounded once in float32, as the Triton kernel does).
    On CPU each chunk looks up the +-1 patterns of its bytes in a (256, 8) table and scales
    each group in place while the chunk is in cache.
    """
    step_scales = scales.float() if weight is None else scales.float() * weight
    add = weight is not None
    if not _use_numpy(out, group):
        _unpack_torch(packed, step_scales, ns, group, out, add=add)
    elif _aligned(ns, group):
        _unpack_aligned(packed, step_scales, group, out, add=add)
    else:
        _unpack_chunked(packed, step_scales, ns, group, out, add=add)


def unpack(packed: Tensor, scales: Tensor, group: int, out: Tensor) -> None:
    """Decode into `out` (n,) float32: ``out[i] = scale[i // group] * (+1 if bit else -1)``."""
    unpack_many([packed], scales, [out.numel()], group, out)


def accumulate(packed: Tensor, scales: Tensor, group: int, out: Tensor, weight: float) -> None:
    """``out += weight * decode(packed, scales)`` for `out` (n,) float32.

    Each value adds ``+-(weight * scale)`` (the product rounded once in float32), the same
    arithmetic as the fused Triton kernel, so both give bit-identical sums.
    """
    unpack_many([packed], scales, [out.numel()], group, out, weight=weight)


def apply_(weights: Tensor, packed: Tensor, scales: Tensor, group: int, alpha: float) -> None:
    """In place ``weights += alpha * decode(packed, scales)`` for float32/float16/bfloat16 weights.

    The sum is formed in float32 and rounded once to the weights' dtype (round to nearest even).
    """
    flat = weights.view(-1)
    step = torch.empty(flat.numel(), dtype=torch.float32, device=flat.device)
    unpack(packed, scales.float() * alpha, group, step)
    if flat.dtype == torch.float32:
        flat.add_(step)
    else:
        flat.copy_(step.add_(flat.float()))
