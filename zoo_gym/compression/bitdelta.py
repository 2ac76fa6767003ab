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

import math

import numpy as np
import torch
from torch import Tensor

_MAGIC = 0x8040201008040201 - (1 << 64)  # the constant as a signed int64
_LOW_BITS = 0x0101010101010101
_CHUNK = 1 << 18  # values per chunk on CPU
_SIGN_TABLE = torch.from_numpy(
    np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1).astype(np.float32) * 2 - 1
)  # (256, 8): row p holds +-1 for the eight bits of byte p, most significant first


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
    (Liu et al., 2024). On CPU the tensor is processed in cache-sized chunks (signs with
    ``numpy.packbits``, sums of ``|x|`` per group); elsewhere by `pack_signs` and `group_reduce`.
    """
    if not _use_numpy(x, group):
        return pack_signs(x), group_reduce(x, group, ord=1)
    n = x.numel()
    flat = x.reshape(-1).numpy()
    packed = np.empty((n + 7) // 8, dtype=np.uint8)
    scales = torch.empty(-(-n // group), dtype=torch.float32)
    chunk = _chunk_len(group)
    absbuf = torch.empty(min(chunk, n), dtype=torch.float32)
    signbuf = np.empty(min(chunk, n), dtype=np.bool_)
    for start in range(0, n, chunk):
        stop = min(start + chunk, n)
        part = flat[start:stop]
        np.greater_equal(part, 0, out=signbuf[: stop - start])
        packed[start // 8 : (stop + 7) // 8] = np.packbits(signbuf[: stop - start])
        absx = torch.abs(torch.from_numpy(part), out=absbuf[: stop - start])
        full, tail = divmod(stop - start, group)
        g0 = start // group
        if full:
            torch.sum(absx[: full * group].view(full, group), 1, out=scales[g0 : g0 + full])
            scales[g0 : g0 + full] /= group
        if tail:
            scales[g0 + full] = absx[full * group :].sum() / tail
    return torch.from_numpy(packed), scales


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


def _signed_chunked(packed: Tensor, scales: Tensor, group: int, out: Tensor, *, add: bool) -> None:
    """CPU path of `_signed` (``add=False``) and of ``out += _signed(...)`` (``add=True``).

    Each chunk looks up +-1 patterns of its bytes in a (256, 8) table and multiplies each group
    by its scale in place (an exact product with +-1), while the chunk is still in cache.
    """
    n = out.numel()
    chunk = _chunk_len(group)
    step = torch.empty(min(chunk, (n + 7) // 8 * 8), dtype=torch.float32)
    for start in range(0, n, chunk):
        stop = min(start + chunk, n)
        length = stop - start
        nbytes = (length + 7) // 8
        index = packed[start // 8 : start // 8 + nbytes].long()
        direct = not add and length % 8 == 0
        dest = out[start:stop] if direct else step[: nbytes * 8]
        torch.index_select(_SIGN_TABLE, 0, index, out=dest.view(nbytes, 8))
        full, tail = divmod(length, group)
        g0 = start // group
        if full:
            dest[: full * group].view(full, group).mul_(scales[g0 : g0 + full, None])
        if tail:
            dest[full * group : length].mul_(scales[g0 + full])
        if add:
            out[start:stop].add_(dest[:length])
        elif not direct:
            out[start:stop].copy_(dest[:length])


def unpack(packed: Tensor, scales: Tensor, group: int, out: Tensor) -> None:
    """Decode into `out` (n,) float32: ``out[i] = scale[i // group] * (+1 if bit else -1)``."""
    if _use_numpy(out, group):
        _signed_chunked(packed, scales.float(), group, out, add=False)
    else:
        _signed(unpack_signs(packed, out.numel()), scales.float(), group, out)


def accumulate(packed: Tensor, scales: Tensor, group: int, out: Tensor, weight: float) -> None:
    """``out += weight * decode(packed, scales)`` for `out` (n,) float32.

    Each value adds ``+-(weight * scale)`` (the product rounded once in float32), the same
    arithmetic as the fused Triton kernel, so both give bit-identical sums.
    """
    weighted = scales.float() * weight
    if _use_numpy(out, group):
        _signed_chunked(packed, weighted, group, out, add=True)
        return
    step = torch.empty_like(out)
    out.add_(_signed(unpack_signs(packed, out.numel()), weighted, group, step))


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
