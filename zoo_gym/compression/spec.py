"""Codec parameters: which codec, how values are grouped, how scales are stored."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

CODECS = ("bitdelta", "int8", "int4", "int2", "ternary", "fp16", "bf16", "none")
"""Codec names, in no particular order; their wire ids are `CODEC_IDS`."""

CODEC_IDS = {
    "none": 0,
    "fp16": 1,
    "bf16": 2,
    "bitdelta": 3,
    "int8": 4,
    "int4": 5,
    "int2": 6,
    "ternary": 7,
}
Granularity = Literal["group", "row", "matrix"]
GRANULARITIES: tuple[Granularity, ...] = get_args(Granularity)
SCALE_DTYPES = ("float16", "bfloat16", "float32")
SCALED_CODECS = frozenset({"bitdelta", "int8", "int4", "int2", "ternary"})
MAX_GROUP_SIZE = 2**31 - 1


@dataclass(frozen=True)
class CodecSpec:
    """How a delta is compressed.

    Parameters
    ----------
    codec
        One of ``"bitdelta"`` (1 sign bit per value plus one scale per group, Liu et al., 2024,
        "BitDelta: Your Fine-Tune May Only Be Worth One Bit"), ``"int8"``, ``"int4"``, ``"int2"``,
        ``"ternary"`` (symmetric per-group absmax quantisers), ``"fp16"``, ``"bf16"`` or
        ``"none"`` (raw float32).
    group_size
        Number of consecutive values sharing one scale when ``granularity == "group"``. The last
        group of a tensor may be partial.
    granularity
        ``"group"`` (``group_size`` consecutive values), ``"row"`` (one scale per slice along the
        first dimension) or ``"matrix"`` (one scale per tensor, as in the BitDelta paper). Applies
        to every scaled codec; ignored by ``fp16``, ``bf16`` and ``none``.
    scale_dtype
        Storage type of the scales. ``"float16"`` (default) gives 1.125 bits per value for
        BitDelta at group 128 and represents scales from 6e-5 to 65504 at full precision;
        ``"float32"`` (1.25 bits per value) covers any magnitude.
    """

    codec: str = "bitdelta"
    group_size: int = 128
    granularity: str = "group"
    scale_dtype: str = "float16"

    def __post_init__(self) -> None:
        if self.codec not in CODEC_IDS:
            raise ValueError(f"unknown codec {self.codec!r}; choose one of {', '.join(CODECS)}")
        if self.granularity not in GRANULARITIES:
            raise ValueError(
                f"unknown granularity {self.granularity!r}; choose one of {', '.join(GRANULARITIES)}"
            )
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int):
            raise ValueError(f"group_size must be an int, got {type(self.group_size).__name__}")
        if not 1 <= self.group_size <= MAX_GROUP_SIZE:
            raise ValueError(f"group_size must be in [1, {MAX_GROUP_SIZE}], got {self.group_size}")
        if self.scale_dtype not in SCALE_DTYPES:
            raise ValueError(
                f"unknown scale_dtype {self.scale_dtype!r}; choose one of {', '.join(SCALE_DTYPES)}"
            )

    @property
    def scaled(self) -> bool:
        """Whether this codec stores per-group scales."""
        return self.codec in SCALED_CODECS


def group_length(spec: CodecSpec, shape: tuple[int, ...]) -> int:
    """Number of consecutive values that share one scale in a tensor of `shape`.

    ``group`` -> ``group_size``; ``row`` -> ``numel / shape[0]`` (the whole tensor when it has
    fewer than two dimensions); ``matrix`` -> ``numel``. Always at least 1.
    """
    n = 1
    for size in shape:
        n *= size
    if spec.granularity == "group":
        return spec.group_size
    if spec.granularity == "row" and len(shape) >= 2 and shape[0] > 0:
        return max(n // shape[0], 1)
    return max(n, 1)


def n_groups(n: int, group: int) -> int:
    """Number of groups of `group` values covering `n` values (the last may be partial)."""
    return -(-n // group)


def carry_spec(codec: CodecSpec, carry_codec: str) -> CodecSpec:
    """The codec of the carried Bs of a round whose update uses `codec` (FFA-LoRA's first
    round of an epoch of A, `zoo_gym.client.feedback`): `codec` itself when `carry_codec`
    is "" or names it (one codec, a version 2 envelope), else `carry_codec` with `codec`'s
    group size and granularity and float32 scales (a residual's values can be small enough
    for a float16 scale max|x| / 127 to fall below float16's normal range, 6.1e-5, where it
    loses precision)."""
    if carry_codec in ("", codec.codec):
        return codec
    return CodecSpec(carry_codec, codec.group_size, codec.granularity, "float32")
