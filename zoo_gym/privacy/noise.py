"""The Gaussian mechanism on model updates [Dwork & Roth, 2014, Thm. A.1].

Noise comes from a generator seeded from the operating system's CSPRNG
(`secrets`), never from a fixed or guessable seed: a predictable noise stream
lets anyone subtract the noise and voids the guarantee.
"""

from __future__ import annotations

import secrets

import torch

from zoo_gym.core.delta import Delta


def secure_generator(device: str | torch.device = "cpu") -> torch.Generator:
    """A torch generator on `device` seeded with 63 bits from `secrets`."""
    return torch.Generator(device=device).manual_seed(secrets.randbits(63))


def add_gaussian_noise(delta: Delta, *, std: float, generator: torch.Generator) -> Delta:
    """Return ``delta + N(0, std^2 I)``, noise drawn in float32 (or the tensor's wider dtype).

    For (epsilon, delta)-DP on a clipped update use ``std = noise_multiplier * C``.
    """
    if std < 0 or not std == std:
        raise ValueError(f"std must be >= 0, got {std}")
    noisy: Delta = {}
    for name, tensor in sorted(delta.items()):
        dtype = torch.float64 if tensor.dtype == torch.float64 else torch.float32
        noise = torch.randn(
            tensor.shape, generator=generator, dtype=dtype, device=generator.device
        ).mul_(std)
        noisy[name] = (tensor.to(dtype) + noise.to(tensor.device)).to(tensor.dtype)
    return noisy
