"""BitDelta sign packing: the torch reference (and CPU path) of the Triton kernels.

BitDelta [Liu et al., 2024, "BitDelta: Your Fine-Tune May Only Be Worth One Bit"] stores a
delta as ``scale * sign(delta)``. For a group of values x (n,) the L2-optimal scale of a sign
quantiser is ``argmin_a ||x - a sign(x)||^2 = mean |x|``.

Bit layout (shared with `zoo_gym.compression.kernels`): value ``8i + j`` of a tensor is bit
``7 - j`` of byte ``i`` (most significant bit first, as ``numpy.packbits``); the bit is 1 when
the value is ``>= 0`` (so 0 and -0.0 decode to ``+scale``) and 0 when it is negative. A
tensor of n values takes ``ceil(n / 8)`` bytes; unused low bits of the last byte are 0.
Groups are ``group`` consecutive values of the flattened tensor; the last may be partial.

Packing avoids per-bit passes with two 64-bit multiplications: eight 0/1 bytes read as one
little-endian int64 ``v`` gather into the top byte of ``v * 0x8040201008040201``, and a byte
``p`` spreads back into eight 0/1 bytes as ``((p * 0x8040201008040201) >> 7) & 0x01..01``
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

_MAGIC = 0x8040201008040201 - (1 << 64)  # the constant as a signed int64
_LOW_BITS = 0x0101010101010101
_CHUNK = 1 << 18  # values per chunk on CPU
_SIGN_TABLE = torch.from_numpy(
    np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1).astype(np.float32) * 2 - 1
)  # (256, 8): row p holds +-1 for the eight bits of byte p, most significant first

_Segment = tuple[int, int, int, int]  # (tensor, start, length, padded), see `_segments`


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


def _chunk_len(group: int) -> int:
    """Values per chunk of the CPU path: whole groups and whole bytes, about 1 MiB of float32."""
    unit = math.lcm(group, 8)
    return unit * max(1, _CHUNK // unit)


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


def _pack_aligned(xs: Sequence[Tensor], ns: list[int], group: int) -> tuple[list[Tensor], Tensor]:
    """`pack_many` of a short update whose tensors all hold whole groups and whole bytes:
    concatenated, such tensors pack exactly as they do one by one, in a few calls."""
    flat = torch.cat([x.detach().reshape(-1) for x in xs]).float()  # (sum n_i,)
    signs = np.empty(flat.numel(), dtype=np.bool_)
    np.greater_equal(flat.numpy(), 0, out=signs)
    bits = torch.from_numpy(np.packbits(signs))
    scales = torch.sum(flat.abs_().view(-1, group), 1).div_(group)
    return list(torch.split(bits, [n // 8 for n in ns])), scales


def _buffer_len(ns: Sequence[int], group: int) -> int:
    """Values in the chunk buffers: one chunk, or fewer when the whole update is smaller."""
    unit = math.lcm(group, 8)
    return min(_chunk_len(group), sum(-(-n // unit) * unit for n in ns))


def _read_run(
    segment: _Segment, flats: Sequence[Tensor], signs: NDArray[np.bool_], absbuf: Tensor
) -> int:
    """Write ``x >= 0`` and ``|x|`` of one long segment, read in place, into the chunk buffers
    `signs` and `absbuf`, zero-padded; return its padded length."""
    i, start, length, padded = segment
    part = flats[i].numpy()[start : start + length]
    absnp = absbuf.numpy()
    np.greater_equal(part, 0, out=signs[:length])
    np.abs(part, out=absnp[:length])
    absnp[length:padded] = 0.0
    signs[length:padded] = False
    return padded


def _gather_short(
    chunk: list[_Segment],
    flats: Sequence[Tensor],
    zeros: Tensor,
    signs: NDArray[np.bool_],
    absbuf: Tensor,
) -> int:
    """Write ``x >= 0`` and ``|x|`` of many short segments, gathered zero-padded with one
    ``torch.cat``, into the chunk buffers `signs` and `absbuf`; return their padded length."""
    pieces = []
    for i, start, length, padded in chunk:
        pieces.append(flats[i][start : start + length])
        if padded > length:
            pieces.append(zeros[: padded - length])
    size = sum(padded for _, _, _, padded in chunk)
    torch.cat(pieces, out=absbuf[:size])
    values = absbuf.numpy()[:size]
    np.greater_equal(values, 0, out=signs[:size])
    np.abs(values, out=values)
    end = 0
    for _, _, length, padded in chunk:
        signs[end + length : end + padded] = False  # a padded zero is not ">= 0"
        end += padded
    return size


def _group_means(abs_values: Tensor, chunk: list[_Segment], group: int) -> Tensor:
    """Mean of each group of the chunk's `abs_values` (size,) -> (size / group,); the last group
    of a segment divides by its real length, the padded zeros adding nothing to its sum."""
    sums = torch.sum(abs_values.view(-1, group), 1)
    counts = torch.full_like(sums, float(group))
    off = 0
    for _, _, length, padded in chunk:
        if length % group:
            counts[(off + length) // group] = float(length % group)
        off += padded
    return sums.div_(counts)


def _scatter_chunk(
    chunk: list[_Segment],
    bits: NDArray[np.uint8],
    means: NDArray[np.float32],
    goff: Sequence[int],
    group: int,
    packed: list[NDArray[np.uint8]],
    scales: NDArray[np.float32],
) -> None:
    """Copy the packed `bits` and group `means` of a chunk to each segment's place in its
    tensor's `packed` bytes and in the concatenated `scales` (`goff` from `_group_offsets`)."""
    off = 0
    for i, start, length, padded in chunk:
        nb, k = (length + 7) // 8, -(-length // group)
        packed[i][start // 8 : start // 8 + nb] = bits[off // 8 : off // 8 + nb]
        g = goff[i] + start // group
        scales[g : g + k] = means[off // group : off // group + k]
        off += padded


def _pack_chunked(xs: Sequence[Tensor], ns: list[int], group: int) -> tuple[list[Tensor], Tensor]:
    """`pack_many` on CPU, streaming the values through cache-sized chunks of `_segments`."""
    flats = [x.detach().reshape(-1).contiguous() for x in xs]
    goff = _group_offsets(ns, group)
    packed = [np.empty((n + 7) // 8, dtype=np.uint8) for n in ns]
    scales = torch.empty(goff[-1], dtype=torch.float32)
    scales_np = scales.numpy()
    limit = _buffer_len(ns, group)
    signs = np.empty(limit, dtype=np.bool_)
    absbuf = torch.empty(limit, dtype=torch.float32)
    zeros = torch.zeros(math.lcm(group, 8), dtype=torch.float32)
    for chunk in _segments(ns, group):
        if len(chunk) == 1:
            size = _read_run(chunk[0], flats, signs, absbuf)
        else:
            size = _gather_short(chunk, flats, zeros, signs, absbuf)
        bits = np.packbits(signs[:size])
        means = _group_means(absbuf[:size], chunk, group).numpy()
        _scatter_chunk(chunk, bits, means, goff, group, packed, scales_np)
    return [torch.from_numpy(p) for p in packed], scales


def _pack_torch(xs: Sequence[Tensor], group: int) -> tuple[list[Tensor], Tensor]:
    """`pack_many` with torch operations only, tensor by tensor: any device, any group size."""
    signs = [pack_signs(x) for x in xs]
    return signs, torch.cat([group_reduce(x.reshape(-1), group, ord=1) for x in xs])


def pack_many(xs: Sequence[Tensor], group: int) -> tuple[list[Tensor], Tensor]:
    """BitDelta-compress flat float32 tensors `xs` (n_i,) that share one group size.

    Returns (packed signs per tensor (ceil(n_i / 8),) uint8, the scales of all tensors
    concatenated (sum_i ceil(n_i / group),) float32), each equal to `pack` of that tensor.
    ``scale_k = mean |x|`` over group k (Liu et al., 2024). On CPU the values stream through
    cache-sized chunks: short tensors share a chunk, each zero-padded to a multiple of
    lcm(group, 8) values (a padded zero adds nothing to a group's sum of |x| and its sign bit
    is cleared), so one ``numpy.packbits`` and one grouped sum serve many tensors.
    """
    if not xs:
        return [], torch.empty(0, dtype=torch.float32)
    if not all(_use_numpy(x, group) for x in xs):
        return _pack_torch(xs, group)
    ns = [x.numel() for x in xs]
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
