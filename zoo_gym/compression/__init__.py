"""Compression of model deltas: BitDelta, DeltaQuant quantisers, the versioned envelope.

BitDelta [Liu et al., 2024, "BitDelta: Your Fine-Tune May Only Be Worth One Bit"] sends one
sign bit per value plus one scale per group (mean |delta|): 1.125 bits per value at group 128
with float16 scales, 14.2x smaller than bf16. Clients keep an `ErrorFeedback` residual.
Every payload is an envelope (see `zoo_gym.compression.envelope`); untrusted bytes only ever
raise `EnvelopeError`.
"""

from zoo_gym.compression import bitdelta, kernels
from zoo_gym.compression.envelope import (
    EnvelopeHeader,
    TensorSection,
    decode,
    decode_into,
    encode,
    inspect_envelope,
)
from zoo_gym.compression.error_feedback import ErrorFeedback
from zoo_gym.compression.errors import EnvelopeError
from zoo_gym.compression.norms import (
    NonFiniteUpdate,
    envelope_norm,
    feedback_cap,
    honest_norm_bound,
)
from zoo_gym.compression.ops import apply_update_, decode_accumulate
from zoo_gym.compression.spec import CODECS, CodecSpec, carry_spec


def bits_per_value(payload: bytes, *, max_elements: int) -> float:
    """Envelope size in bits divided by the number of values it carries."""
    header = inspect_envelope(payload, max_elements=max_elements)
    return 8 * len(payload) / max(header.total_elements, 1)


__all__ = [
    "CODECS",
    "CodecSpec",
    "EnvelopeError",
    "EnvelopeHeader",
    "ErrorFeedback",
    "NonFiniteUpdate",
    "TensorSection",
    "apply_update_",
    "bitdelta",
    "bits_per_value",
    "carry_spec",
    "decode",
    "decode_accumulate",
    "decode_into",
    "encode",
    "envelope_norm",
    "feedback_cap",
    "honest_norm_bound",
    "inspect_envelope",
    "kernels",
]
