"""L2 norms of envelopes, and the largest norm an honest update can reach after compression.

A contributor sends ``C(y)``: the codec ``C`` applied to ``y = u + e``, where ``u`` is its update
(clipped to norm ``clip`` and, optionally, with Gaussian noise of std ``sigma * clip`` per value)
and ``e`` the error-feedback residual it carries from earlier rounds. The coordinator can bound
``||C(y)||_2`` once it knows how much each factor may grow:

1. ``||u|| <= clip + noise_norm_bound(sigma * clip, d)`` except with probability ``1e-12``.
2. The residual is not bounded by the clipping (a sign compressor transmits only part of ``y``
   and the rest waits), so the client scales ``y`` down to ``FEEDBACK_HEADROOM`` times the bound
   of 1. before encoding and keeps what it removed in the residual (`feedback_cap`); nothing
   is dropped, it is sent later.
3. ``||C(y)|| <= codec_growth(spec, groups) * ||y||`` (see `codec_growth`).

`honest_norm_bound` is the product plus a relative `TOLERANCE` for rounding. `envelope_norm`
computes ``||decode(payload)||_2`` tensor by tensor: BitDelta from its scales alone (all of an
envelope's scales in one pass where its tensors share a group size), the other codecs in
chunks, so memory stays bounded by one tensor.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Mapping

import torch

from zoo_gym.compression import codecs
from zoo_gym.compression.envelope import (
    EnvelopeHeader,
    TensorSection,
    _frombuffer,
    bitdelta_parts,
    section_tensors,
    unpacks_together,
)
from zoo_gym.compression.errors import EnvelopeError
from zoo_gym.compression.spec import CodecSpec, group_length
from zoo_gym.core.delta import Layout

NOISE_FAILURE = 1e-12
"""Probability that honest Gaussian update noise exceeds `noise_norm_bound`."""
FEEDBACK_HEADROOM = 3.0
"""An honest client's compensated update ``u + e`` is scaled to at most this many times the
bound on ``||u||`` (a residual of up to twice the update; measured residuals of BitDelta with
error feedback stay below about 1.5 times the update)."""
TOLERANCE = 0.01
"""Relative slack for rounding: updates held in bfloat16 (2^-8) and scales in float16 (2^-11)."""
_SCALE_ROUNDING = {"float16": 2.0**-11, "bfloat16": 2.0**-8, "float32": 2.0**-24}
_RAW_ROUNDING = {"fp16": 2.0**-11, "bf16": 2.0**-8, "none": 0.0}
_CHUNK = 1 << 20  # values per step when a tensor is read in float64


class NonFiniteUpdate(EnvelopeError):
    """An envelope whose values or scales include NaN or Inf."""


def noise_norm_bound(std: float, d: int, *, failure: float = NOISE_FAILURE) -> float:
    """An upper bound on ``||z||_2`` for ``z ~ N(0, std^2 I_d)`` that fails with probability
    at most `failure`.

    ``||z|| / std`` is a 1-Lipschitz function of a standard Gaussian vector with mean at most
    ``sqrt(d)``, so ``P(||z|| >= std (sqrt(d) + t)) <= exp(-t^2 / 2)`` (Gaussian concentration,
    Boucheron, Lugosi and Massart, 2013, Thm. 5.6); ``t = sqrt(2 ln(1 / failure))``.
    """
    if std <= 0 or d <= 0:
        return 0.0
    return std * (math.sqrt(d) + math.sqrt(2.0 * math.log(1.0 / failure)))


def feedback_cap(clip_norm: float, noise_multiplier: float, d: int) -> float:
    """The norm an honest client scales its compensated update ``u + e`` down to before encoding:
    `FEEDBACK_HEADROOM` x (clip_norm + `noise_norm_bound` of noise std ``noise_multiplier *
    clip_norm`` over `d` values). 0.0 when `clip_norm` is 0 (no cap)."""
    if clip_norm <= 0:
        return 0.0
    return FEEDBACK_HEADROOM * (clip_norm + noise_norm_bound(noise_multiplier * clip_norm, d))


def codec_growth(spec: CodecSpec, group_lengths: Iterable[int]) -> float:
    """The largest ``||C(x)||_2 / ||x||_2`` of the codec over tensors with these group lengths.

    - bitdelta: a group x_g (k values) decodes to ``+-s`` with ``s = ||x_g||_1 / k``, so
      ``||C(x_g)|| = ||x_g||_1 / sqrt(k) <= ||x_g||_2`` (Cauchy-Schwarz): BitDelta never grows
      a norm, up to the rounding of the stored scale (relative ``u``): ``1 + u``.
    - int8, int4, ternary (round to nearest, zero level, ``L`` levels a side): a code
      ``q != 0`` needs ``|x_i| >= s / 2``, and ``|q s| <= |x_i| + s / 2 <= 2 |x_i|``: 2. Also
      ``||C(x_g) - x_g|| <= sqrt(k) s / 2`` with ``s <= (1 + u) max|x_g| / L``, so
      ``||C(x_g)|| <= (1 + (1 + u) sqrt(k) / (2 L)) ||x_g||`` (1.045 for int8 at k = 128):
      the smaller of the two, for the longest group k.
    - int2 (no zero level): ``|q s| <= |x_i| + s`` with ``s <= (1 + u) max|x_g| / 3``, so
      ``||C(x_g)|| <= (1 + (1 + u) sqrt(k) / 3) ||x_g||`` for the longest group k.
    - fp16, bf16: one rounding per value (2^-11, 2^-8); none: 1.
    """
    u = _SCALE_ROUNDING[spec.scale_dtype]
    if spec.codec == "bitdelta":
        return 1.0 + u
    longest = max(group_lengths, default=1)
    if spec.codec in ("int8", "int4", "ternary"):
        return min(2.0, 1.0 + (1.0 + u) * math.sqrt(longest) / (2 * codecs.LEVELS[spec.codec]))
    if spec.codec == "int2":
        return 1.0 + (1.0 + u) * math.sqrt(longest) / 3.0
    return 1.0 + _RAW_ROUNDING[spec.codec]


def honest_norm_bound(
    spec: CodecSpec,
    layout: Layout,
    *,
    clip_norm: float,
    noise_multiplier: float = 0.0,
    own: Mapping[str, CodecSpec] | None = None,
) -> float:
    """The largest ``||decode(envelope)||_2`` an honest client following a task sends:
    ``(1 + TOLERANCE) * codec_growth * feedback_cap``, plus ``sqrt(d) * 2^-24`` for float16
    scales rounded up below their normal range. 0.0 (no bound) when `clip_norm` is 0.

    Tensors named in `own` are compressed with that codec instead of `spec` (a version 3
    envelope): the growth is the largest of any tensor's, since
    ``sum_t ||C_t(y_t)||² <= max_t g_t² sum_t ||y_t||²``.
    """
    d = sum(ts.numel for ts in layout)
    cap = feedback_cap(clip_norm, noise_multiplier, d)
    if cap <= 0:
        return 0.0
    own = own or {}
    growth = max(
        (
            codec_growth(own.get(ts.name, spec), [group_length(own.get(ts.name, spec), ts.shape)])
            for ts in layout
        ),
        default=codec_growth(spec, []),
    )
    return (1.0 + TOLERANCE) * growth * cap + math.sqrt(d) * 2.0**-24


def envelope_norm(payload: bytes, header: EnvelopeHeader) -> float:
    """``||decode(payload)||_2`` (float64 sums), one tensor at a time, or for an envelope of
    BitDelta tensors of one group size (`unpacks_together`) from all scales at once.

    `header` is `inspect_envelope(payload)`. Raises `NonFiniteUpdate` naming the first tensor
    with a NaN or Inf value or scale, `EnvelopeError` for other invalid content.
    """
    if unpacks_together(header):
        with contextlib.suppress(EnvelopeError):  # the pass below names what is wrong
            return math.sqrt(_bitdelta_squared_norm(payload, header))
    total = 0.0
    for section in header.sections:
        total += _squared_norm(payload, section)
    return math.sqrt(total)


def _bitdelta_squared_norm(payload: bytes, header: EnvelopeHeader) -> float:
    """Sum over groups of ``scale² * values in the group`` (every value of a group is +-its
    scale), every scale and padding checked by `bitdelta_parts` in one pass."""
    _, scales = bitdelta_parts(payload, header)
    sections = [s for s in header.sections if s.n_groups]
    groups = torch.tensor([s.n_groups for s in sections], dtype=torch.long)
    counts = torch.repeat_interleave(
        torch.tensor([float(s.group) for s in sections], dtype=torch.float64), groups
    )
    last = groups.cumsum(0) - 1  # each tensor's last group
    counts[last] = torch.tensor(
        [float(s.spec.numel - (s.n_groups - 1) * s.group) for s in sections], dtype=torch.float64
    )
    return float((scales.double().square() * counts).sum())


def _squared_norm(payload: bytes, section: TensorSection) -> float:
    """||decode(section)||² of one tensor, in its own codec."""
    name, n = section.spec.name, section.spec.numel
    if not section.codec_spec.scaled:
        return _raw_squared_norm(payload, section.codec, section)
    try:
        scales, data = section_tensors(payload, section)
    except EnvelopeError as exc:
        if "NaN" in str(exc):
            raise NonFiniteUpdate(f"{name}: NaN or Inf scale") from None
        raise
    if section.codec == "bitdelta":  # every value of group g is +-s_g
        codecs.check_padding(data, n, name)
        counts = torch.full((section.n_groups,), float(section.group), dtype=torch.float64)
        if section.n_groups:
            counts[-1] = n - (section.n_groups - 1) * section.group
        return float((scales.double().square() * counts).sum())
    values = torch.empty(n, dtype=torch.float32)
    codecs.decode_tensor(section.codec, scales, data, section.group, values)
    return _sum_squares(values, name)


def _raw_squared_norm(payload: bytes, codec: str, section: TensorSection) -> float:
    dtype = {"none": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[codec]
    values = _frombuffer(payload, section.data_offset, section.data_nbytes, dtype)
    return _sum_squares(values, section.spec.name)


def _sum_squares(values: torch.Tensor, name: str) -> float:
    """Sum of squares in float64, a chunk at a time; a NaN or Inf value makes the sum non-finite
    (finite float32 squares cannot overflow a float64 sum), so no separate pass looks for one."""
    total = 0.0
    for start in range(0, values.numel(), _CHUNK):
        part = torch.linalg.vector_norm(values[start : start + _CHUNK], dtype=torch.float64)
        total += float(part) ** 2
    if not math.isfinite(total):
        raise NonFiniteUpdate(f"{name}: NaN or Inf value")
    return total
