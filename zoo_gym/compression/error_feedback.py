"""Error feedback: what compression did not transmit is added to the next update.

With residual e (zero at first), each round sends C(delta + e) and keeps
``e <- delta + e - C(delta + e)``. The sum of transmitted deltas then differs from the sum
of true deltas by exactly the current residual, which stays bounded for a contractive C such
as scaled signs (Karimireddy et al., 2019, "Error Feedback Fixes SignSGD"); without it 1-bit
updates drift. Used by BitDelta clients (Liu et al., 2024) by default.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from zoo_gym.compression.envelope import decode, encode
from zoo_gym.compression.spec import CodecSpec
from zoo_gym.core.delta import Delta


class ErrorFeedback:
    """Residual per tensor name (float32, CPU), persisted with `state_dict`."""

    def __init__(self) -> None:
        self.residual: dict[str, Tensor] = {}

    def compress(self, delta: Delta, spec: CodecSpec) -> tuple[bytes, Delta]:
        """Encode ``delta + residual``; return (payload, transmitted delta) and keep the new residual.

        The transmitted delta is exactly what ``decode(payload)`` yields on the coordinator.
        """
        compensated: Delta = {}
        for name, tensor in delta.items():
            value = tensor.detach().to(device="cpu", dtype=torch.float32)
            stored = self.residual.get(name)
            if stored is not None:
                if stored.shape != value.shape:
                    raise ValueError(
                        f"{name}: residual shape {tuple(stored.shape)} != delta {tuple(value.shape)}"
                    )
                value = value + stored
            compensated[name] = value
        payload = encode(compensated, spec)
        total = sum(t.numel() for t in compensated.values())
        transmitted = decode(payload, max_elements=total)
        for name, value in compensated.items():
            self.residual[name] = value - transmitted[name]
        return payload, transmitted

    def state_dict(self) -> dict[str, Tensor]:
        """A copy of the residuals, name -> float32 tensor (safetensors-compatible)."""
        return {name: t.clone().contiguous() for name, t in self.residual.items()}

    def load_state_dict(self, state: Mapping[str, Tensor]) -> None:
        """Replace the residuals with float32 copies of `state`; rejects non-finite values."""
        loaded: dict[str, Tensor] = {}
        for name, tensor in state.items():
            value = tensor.detach().to(device="cpu", dtype=torch.float32).clone()
            if not bool(torch.isfinite(value).all()):
                raise ValueError(f"{name}: residual has NaN or Inf values")
            loaded[name] = value
        self.residual = loaded

    def reset(self) -> None:
        """Forget all residuals (for instance when the base model changes)."""
        self.residual = {}
