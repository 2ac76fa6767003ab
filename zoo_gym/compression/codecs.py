"""Per-tensor codecs: a flat float32 tensor (n,) <-> (scales (G,), packed bytes).

Scaled codecs share one scale per group of `group` consecutive values (the last group may be
partial); the scale is stored in the spec's ``scale_dtype`` and the encoder quantises against
the stored (rounded) scale, so decoding reproduces exactly what the encoder measured.

======== ================================ ======================== ======================
codec    scale s of a group               value of code q          packing
======== ================================ ======================== ======================
bitdelta mean |x| (Liu et al., 2024)      +-s                      1 bit, see `bitdelta`
int8     max |x| / 127                    q * s, q in [-127, 127]  1 byte, two's complement
int4     max |x| / 7                      q * s, q in [-7, 7]      nibble q + 8, value 2i
                                                                   in the low nibble
int2     max |x| / 3                      q * s, q in {-3,-1,1,3}  2 bits (q + 3) / 2,
                                                                   value 4i + j at bits 2j
ternary  max |x|                          q * s, q in {-1, 0, 1}   base 3: byte = sum of
                                                                   (q_j + 1) 3^j, 5 values
fp16     none                             IEEE half                2 bytes little-endian
bf16     none                             bfloat16                 2 bytes little-endian
none     none                             float32                  4 bytes little-endian
======== ================================ ======================== ======================

``int2`` is the symmetric 4-level (mid-rise) quantiser: it has no zero level, so a value in
``[0, 2s)`` becomes ``+s``. Integer codes round half to even. Padding (unused bits of the
last byte) is always zero and checked on decode.
"""

from __future__ import annotations

import torch
from torch import Tensor

from zoo_gym.compression import bitdelta, kernels
from zoo_gym.compression.errors import EnvelopeError

SCALE_TORCH_DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
}
LEVELS = {"int8": 127, "int4": 7, "int2": 3, "ternary": 1, "bitdelta": 1}
"""Largest |code| of each scaled codec: decoded values are bounded by ``LEVELS * scale``."""

_VALUES_PER_BYTE = {"bitdelta": 8, "int8": 1, "int4": 2, "int2": 4, "ternary": 5}
_RAW_BYTES = {"none": 4, "fp16": 2, "bf16": 2}
_RAW_DTYPES = {"none": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_POW3 = torch.tensor([1, 3, 9, 27, 81], dtype=torch.int16)


def data_nbytes(codec: str, n: int) -> int:
    """Bytes of packed values for `n` values."""
    if codec in _RAW_BYTES:
        return _RAW_BYTES[codec] * n
    return -(-n // _VALUES_PER_BYTE[codec])


def expand(scales: Tensor, n: int, group: int) -> Tensor:
    """Per-value scale (n,) from per-group scales (G,)."""
    return scales.repeat_interleave(group)[:n] if group > 1 else scales[:n]


def _quantise(x: Tensor, s: Tensor, codec: str) -> Tensor:
    """Integer codes (n,) int16 of `x` against per-value scales `s` (n,)."""
    level = LEVELS[codec]
    ratio = torch.div(x, s).nan_to_num_(0.0, posinf=level, neginf=-level)
    if codec == "int2":
        return (torch.floor(ratio / 2) * 2 + 1).clamp_(-3, 3).to(torch.int16)
    return torch.round(ratio).clamp_(-level, level).to(torch.int16)


def _pack_codes(codes: Tensor, per_byte: int, bits: int) -> Tensor:
    """Pack unsigned codes (n,) of `bits` bits, value ``per_byte*i + j`` at bits ``bits*j``."""
    n = codes.numel()
    m = -(-n // per_byte)
    padded = torch.zeros(m * per_byte, dtype=torch.int16)
    padded[:n] = codes
    grid = padded.view(m, per_byte)
    if bits == 0:  # base 3
        return (grid * _POW3).sum(1).to(torch.uint8)
    shifts = torch.arange(per_byte, dtype=torch.int16) * bits
    return (grid << shifts).sum(1).to(torch.uint8)


def _unpack_codes(data: Tensor, n: int, per_byte: int, bits: int) -> Tensor:
    """Inverse of `_pack_codes`: codes (n,) int16; raises if padding or a base-3 byte is invalid."""
    wide = data.to(torch.int16)
    if bits == 0:
        if bool((wide > 242).any()):
            raise EnvelopeError("ternary byte above 242 (3**5 - 1)")
        grid = torch.div(wide[:, None], _POW3, rounding_mode="floor") % 3
    else:
        shifts = torch.arange(per_byte, dtype=torch.int16) * bits
        grid = (wide[:, None] >> shifts) & ((1 << bits) - 1)
    flat = grid.reshape(-1)
    if bool(flat[n:].any()):
        raise EnvelopeError("non-zero padding after the last value of a tensor")
    return flat[:n]


def encode_tensor(codec: str, x: Tensor, group: int, scale_dtype: str) -> tuple[Tensor, Tensor]:
    """Encode a flat float32 tensor `x` (n,) -> (scales (G,) in `scale_dtype`, bytes (k,) uint8).

    Raises ValueError when a scale or value does not fit the storage type.
    """
    n = x.numel()
    if codec in _RAW_DTYPES:
        raw = x.to(_RAW_DTYPES[codec])
        if not bool(torch.isfinite(raw).all()):
            raise ValueError(f"a value overflows {codec}; choose codec 'none'")
        return torch.empty(0), raw.cpu().view(torch.uint8)
    ord_ = 1.0 if codec == "bitdelta" else float("inf")
    if codec == "bitdelta" and kernels.active_for(x) and kernels.can_pack(group):
        packed, scales = kernels.pack(x, group)  # the CPU path's bytes, see `kernels.pack`
        packed, scales = packed.cpu(), scales.cpu()
    elif codec == "bitdelta":  # on the CPU: a GPU's torch sum could round scales differently
        packed, scales = bitdelta.pack(x.cpu(), group)
    else:  # max |x| is exact in any order; divided on the CPU (CUDA multiplies by 1 / 127)
        scales = bitdelta.group_reduce(x, group, ord=ord_).cpu() / LEVELS[codec]
    stored = scales.to(SCALE_TORCH_DTYPES[scale_dtype])
    if not bool(torch.isfinite(stored).all()):
        raise ValueError(f"a scale overflows {scale_dtype}; use scale_dtype='float32'")
    if codec == "bitdelta":
        return stored, packed
    codes = _quantise(x.cpu(), expand(stored.float().cpu(), n, group), codec)
    if codec == "int8":
        return stored, codes.to(torch.int8).view(torch.uint8)
    if codec == "int4":
        return stored, _pack_codes(codes + 8, 2, 4)
    if codec == "int2":
        return stored, _pack_codes(torch.div(codes + 3, 2, rounding_mode="floor"), 4, 2)
    return stored, _pack_codes(codes + 1, 5, 0)


def check_padding(data: Tensor, n: int, name: str = "") -> None:
    """Refuse sign bits (`n` values packed in `data`) whose last byte has bits set past the end."""
    if n % 8 and int(data[-1]) & ((1 << (8 - n % 8)) - 1):
        where = f"{name}: " if name else ""
        raise EnvelopeError(f"{where}non-zero padding after the last value of a tensor")


def decode_tensor(
    codec: str, scales: Tensor, data: Tensor, group: int, out: Tensor, *, triton: bool = False
) -> None:
    """Decode into `out` (n,) float32 from float32 `scales` (G,) and `data` (k,) uint8.

    The sizes are already checked by the envelope; content errors raise `EnvelopeError`.
    `triton` selects the BitDelta unpack kernel.
    """
    n = out.numel()
    if codec in _RAW_DTYPES:
        out.copy_(data.view(_RAW_DTYPES[codec]))
        if not bool(torch.isfinite(out).all()):
            raise EnvelopeError(f"non-finite value in a {codec} tensor")
        return
    if codec == "bitdelta":
        check_padding(data, n)
        unpack = kernels.unpack if triton else bitdelta.unpack
        unpack(data.to(out.device), scales.to(out.device), group, out)
        return
    codes = _codes(codec, data, n)
    torch.mul(codes.to(out.device), expand(scales.to(out.device), n, group), out=out)


def _codes(codec: str, data: Tensor, n: int) -> Tensor:
    """Signed integer codes (n,) int16 of a quantiser's packed bytes `data`."""
    if codec == "int8":
        return data[:n].view(torch.int8).to(torch.int16)
    if codec == "int4":
        codes = _unpack_codes(data, n, 2, 4) - 8
        if bool((codes == -8).any()):
            raise EnvelopeError("int4 code 0 (value -8) is outside the symmetric range [-7, 7]")
        return codes
    if codec == "int2":
        return _unpack_codes(data, n, 4, 2) * 2 - 3
    return _unpack_codes(data, n, 5, 0) - 1


def values_per_byte(codec: str) -> int:
    """How many values one byte of packed data holds (1 for int8, 8 for BitDelta, ...);
    0 for the raw codecs, whose values take several bytes each."""
    return _VALUES_PER_BYTE.get(codec, 0)


def decode_range(
    codec: str,
    scales: Tensor,
    first_group: int,
    data: Tensor,
    first_byte: int,
    n: int,
    lo: int,
    hi: int,
    group: int,
    out: Tensor,
) -> None:
    """Decode values [lo, hi) of a tensor of `n` values into `out` (hi - lo,) float32.

    `data` holds the tensor's packed bytes from byte `first_byte` on, covering the range
    (for a raw codec, the values' bytes from value `lo`); `scales` (float32) its scales
    from group `first_group` on. The values equal those `decode_tensor` writes at
    [lo, hi); content errors (non-finite raw values, padding after the last value when the
    range reaches it, invalid codes) raise `EnvelopeError`.
    """
    if codec in _RAW_DTYPES:
        out.copy_(data.view(_RAW_DTYPES[codec])[: hi - lo])
        if not bool(torch.isfinite(out).all()):
            raise EnvelopeError(f"non-finite value in a {codec} tensor")
        return
    per_byte = _VALUES_PER_BYTE[codec]
    skip = lo - first_byte * per_byte  # values of the first byte before lo
    index = torch.arange(lo, hi, device=out.device) // group - first_group
    step = scales.to(out.device).index_select(0, index)  # (hi - lo,) per-value scales
    if codec == "bitdelta":
        if hi == n:
            check_padding(data, n - first_byte * 8)
        nbytes = -(-(hi - first_byte * 8) // 8)
        signs = bitdelta.sign_values(data[:nbytes].to(out.device))  # (8 nbytes,) +-1
        torch.mul(signs[skip : skip + hi - lo], step, out=out)
        return
    count = min(n, -(-hi // per_byte) * per_byte) - first_byte * per_byte
    codes = _codes(codec, data[: -(-count // per_byte)], count)
    torch.mul(codes[skip : skip + hi - lo].to(out.device), step, out=out)
