"""The round's update-norm bound admits every honest update, and intake's envelope checks."""

from __future__ import annotations

import hashlib
import math
import struct

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zoo_gym.client.feedback import FfaErrorFeedback
from zoo_gym.compression import (
    CODECS,
    CodecSpec,
    encode,
    envelope_norm,
    feedback_cap,
    honest_norm_bound,
    inspect_envelope,
)
from zoo_gym.compression.norms import FEEDBACK_HEADROOM
from zoo_gym.coordinator.config import CoordinatorConfig, TrainingPolicy
from zoo_gym.coordinator.intake import OpenRound, envelope_reason
from zoo_gym.coordinator.rounds import update_norm_bound
from zoo_gym.core.delta import Delta, Layout, TensorSpec
from zoo_gym.core.lora import LoraSpec
from zoo_gym.privacy.clip import clip_delta
from zoo_gym.privacy.noise import add_gaussian_noise

LORA = LoraSpec(rank=4, alpha=8.0, target_modules=("q", "up"))
IN_FEATURES = {"m.q": 32, "m.up": 48}
LAYOUT: Layout = (
    TensorSpec("m.q.lora_B", (40, 4)),
    TensorSpec("m.up.lora_B", (96, 4)),
    TensorSpec("m.z.weight", (24, 8)),  # a dense delta: plain error feedback
)


def training_update(kind: str, scale: float, generator: torch.Generator) -> Delta:
    """What local training might produce: dense, sparse (one value per stretch) or one fixed
    direction every round (error feedback accumulates most on the last two)."""
    update = {}
    for ts in LAYOUT:
        if kind == "dense":
            x = torch.randn(ts.shape, generator=generator)
        else:
            x = torch.zeros(ts.shape)
            x.view(-1)[:: 64 if kind == "sparse" else 97] = 1.0
            if kind == "sparse":
                x = x * torch.randn(ts.shape, generator=generator).sign()
        update[ts.name] = x * scale
    return update


def honest_rounds(
    spec: CodecSpec, *, clip: float, sigma: float, kind: str, scale: float, rounds: int, seed: int
) -> list[float]:
    """Envelope norms of an honest client's rounds: clip, noise, error feedback with the cap."""
    generator = torch.Generator().manual_seed(seed)
    feedback = FfaErrorFeedback()
    d = sum(ts.numel for ts in LAYOUT)
    norms = []
    for r in range(rounds):
        update, _ = clip_delta(training_update(kind, scale, generator), clip)
        if sigma > 0:
            update = add_gaussian_noise(update, std=sigma * clip, generator=generator)
        payload, _ = feedback.compress(
            update,
            spec,
            lora=LORA,
            seed=seed + r,
            in_features=IN_FEATURES,
            max_norm=feedback_cap(clip, sigma, d),
        )
        norms.append(envelope_norm(payload, inspect_envelope(payload, max_elements=d)))
    return norms


@settings(max_examples=40, deadline=None)
@given(
    codec=st.sampled_from(CODECS),
    granularity=st.sampled_from(["group", "row", "matrix"]),
    clip=st.sampled_from([1e-3, 0.5, 1.0, 20.0]),
    sigma=st.sampled_from([0.0, 0.3, 2.0]),
    kind=st.sampled_from(["dense", "sparse", "fixed"]),
    scale=st.sampled_from([1e-4, 1.0, 100.0]),
    seed=st.integers(0, 2**20),
)
def test_honest_clipped_noised_error_feedback_updates_are_within_the_bound(
    codec: str,
    granularity: str,
    clip: float,
    sigma: float,
    kind: str,
    scale: float,
    seed: int,
) -> None:
    spec = CodecSpec(codec, 16, granularity)
    bound = honest_norm_bound(spec, LAYOUT, clip_norm=clip, noise_multiplier=sigma)

    norms = honest_rounds(spec, clip=clip, sigma=sigma, kind=kind, scale=scale, rounds=6, seed=seed)

    assert max(norms) <= bound, (norms, bound)


def test_without_the_cap_error_feedback_outgrows_the_headroom() -> None:
    # a sparse update clipped to norm 1, the same every round: BitDelta sends ||x||_1 / sqrt(k)
    # of each group, the rest waits in the residual and grows
    feedback = FfaErrorFeedback()
    update = {"w": torch.zeros(4, 128)}
    update["w"][:, 0] = 0.5
    spec = CodecSpec("bitdelta", 128)
    norms = []
    for _ in range(30):
        payload, _ = feedback.compress(update, spec)
        norms.append(envelope_norm(payload, inspect_envelope(payload, max_elements=512)))

    assert max(norms) > FEEDBACK_HEADROOM * 1.0 * (1 + 1e-3)
    capped = FfaErrorFeedback()
    for _ in range(30):
        payload, _ = capped.compress(update, spec, max_norm=feedback_cap(1.0, 0.0, 512))
        assert envelope_norm(payload, inspect_envelope(payload, max_elements=512)) <= 3.01


def test_the_round_bound_comes_from_clip_norm_else_from_the_setting() -> None:
    plain = CoordinatorConfig(max_update_norm=250.0)
    clipped = CoordinatorConfig(
        training=TrainingPolicy(clip_norm=2.0, update_noise_multiplier=0.5, codec="int8")
    )
    off = CoordinatorConfig(max_update_norm=0.0)

    assert update_norm_bound(plain, LAYOUT) == 250.0
    assert update_norm_bound(off, LAYOUT) == 0.0
    d = sum(ts.numel for ts in LAYOUT)
    noise = 0.5 * 2.0 * (math.sqrt(d) + math.sqrt(2 * math.log(1e12)))
    # int8 at group 128 grows a norm at most 1 + sqrt(128) / (2 * 127), float16 scales rounded
    growth = 1 + (1 + 2.0**-11) * math.sqrt(128) / 254
    expected = 1.01 * growth * FEEDBACK_HEADROOM * (2.0 + noise)
    assert abs(update_norm_bound(clipped, LAYOUT) - expected) < 1e-3


def open_round(codec: str = "bitdelta", bound: float = 0.0) -> OpenRound:
    return OpenRound(3, "v0002", LAYOUT, 0, codec=codec, max_update_norm=bound)


def envelope(value: float, codec: str = "bitdelta") -> bytes:
    return encode({ts.name: torch.full(ts.shape, value) for ts in LAYOUT}, CodecSpec(codec))


def test_intake_takes_the_round_codec_only() -> None:
    assert envelope_reason(envelope(0.1), open_round()) == ""
    assert envelope_reason(envelope(0.1, "int4"), open_round("")) == ""  # no codec named
    assert envelope_reason(envelope(0.1, "int4"), open_round()) == (
        "update is encoded with int4 but round 3 asks for bitdelta; compress it with the task's codec"
    )


def test_intake_refuses_an_update_above_the_bound_and_names_both_norms() -> None:
    d = sum(ts.numel for ts in LAYOUT)

    assert envelope_reason(envelope(1.0), open_round(bound=math.sqrt(d) + 1e-6)) == ""
    assert envelope_reason(envelope(1e4), open_round(bound=0.0)) == ""  # 0 turns the bound off
    reason = envelope_reason(envelope(1e4), open_round(bound=100.0))
    assert reason == (
        f"update L2 norm {1e4 * math.sqrt(d):.4g} exceeds round 3's norm bound 100; "
        "send a smaller update (clipped to the task's clip_norm when it sets one)"
    )


def test_intake_refuses_a_nan_scale_before_the_bound() -> None:
    payload = envelope(0.1)
    at = inspect_envelope(payload, max_elements=10_000).sections[0].scales_offset
    body = payload[:at] + struct.pack("<H", 0x7E00) + payload[at + 2 : -32]

    reason = envelope_reason(body + hashlib.sha256(body).digest(), open_round(bound=1.0))

    assert reason == (
        "update has NaN or Inf values (m.q.lora_B: NaN or Inf scale); send finite values"
    )
