"""Client-side error feedback for FFA-LoRA B updates and for dense weight deltas.

1-bit compression loses most of an update's magnitude detail; error feedback keeps
what was not transmitted and sends it later (Seide et al., 2014; Karimireddy et
al., 2019 "EF-SGD"). Two kinds of key are handled:

- FFA-LoRA B matrices (keys ending in ``.lora_B``). Because each round's A is
  regenerated from that round's seed, a residual in B-space would mean something
  else next round. So the residual is kept in weight space, R = s·(B - B̂)·A
  (out, in), and carried into the next round's B by least squares onto the new A:

      B_carry = R Aᵀ (A Aᵀ)⁻¹ / s,        R ← R - s·B_carry·A

  The part of R outside the new A's row space stays in R for later rounds, so
  nothing is dropped. Memory: one float32 (out, in) tensor per target module.
- Any other key (a dense weight delta such as ``model.layers.0.mlp.up_proj.weight``):
  the plain residual e of its own shape, sent as C(delta + e) with
  e ← delta + e - C(delta + e).

The residuals are saved with the client's state (`save` / `load`), so they survive
a restart. ``enabled=False`` sends C(delta) and keeps nothing (for comparisons).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file
from safetensors.torch import save as safetensors_bytes

from zoo_gym.compression import CodecSpec, decode, encode
from zoo_gym.core.delta import Delta
from zoo_gym.core.files import write_atomic
from zoo_gym.core.lora import LoraSpec, frozen_a

SUFFIX = ".lora_B"
log = logging.getLogger(__name__)


class FfaErrorFeedback:
    """Residual per update key (float32, CPU); `enabled` switches error feedback on or off."""

    def __init__(
        self, residual: Mapping[str, torch.Tensor] | None = None, *, enabled: bool = True
    ) -> None:
        self.enabled = enabled
        self.residual: dict[str, torch.Tensor] = dict(residual or {}) if enabled else {}

    def compress(
        self,
        update: Delta,
        codec: CodecSpec,
        *,
        lora: LoraSpec | None = None,
        seed: int = 0,
        in_features: Mapping[str, int] | None = None,
        max_norm: float = 0.0,
    ) -> tuple[bytes, Delta]:
        """Encode `update` plus the carried residuals; keep the new residuals.

        `lora`, `seed` and `in_features` (module -> A's input size) are needed only for
        ``.lora_B`` keys. With `max_norm` > 0 the compensated update is scaled down to that
        L2 norm before encoding and what was removed stays in the residual (sent later), so
        the coordinator's norm bound (`zoo_gym.compression.feedback_cap`) admits it.
        Returns (payload, the delta the coordinator will decode).
        """
        if not self.enabled:
            payload = encode(update, codec)
            return payload, decode(payload, max_elements=sum(t.numel() for t in update.values()))
        frozen: dict[str, torch.Tensor] = {}
        compensated: Delta = {}
        for key, value in update.items():
            if key.endswith(SUFFIX):
                if lora is None or in_features is None:
                    raise ValueError(f"{key}: FFA-LoRA keys need `lora` and `in_features`")
                frozen[key], compensated[key] = self._carry_ffa(key, value, lora, seed, in_features)
            else:
                compensated[key] = self._carry_dense(key, value)
        payload = encode(_capped(compensated, max_norm), codec)
        sent = decode(payload, max_elements=sum(t.numel() for t in compensated.values()))
        for key, value in compensated.items():
            err = value.double() - sent[key].double()
            a = frozen.get(key)
            if a is not None:
                assert lora is not None
                err = lora.scaling * err @ a  # (out, in)
            prev = self.residual.get(key)
            self.residual[key] = (err if prev is None else prev.double() + err).float()
        return payload, sent

    def _carry_ffa(
        self, key: str, b: torch.Tensor, lora: LoraSpec, seed: int, in_features: Mapping[str, int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(frozen A (r, in) float64, B plus the residual's projection onto A (out, r) float32)."""
        module = key.removesuffix(SUFFIX)
        a = frozen_a(seed, module, in_features[module], lora.rank).double()  # (r, in)
        b64 = b.detach().to(device="cpu", dtype=torch.float64)
        r = self._stored(key, (b64.shape[0], a.shape[1]))
        if r is not None:
            s = lora.scaling
            carry = torch.linalg.solve(a @ a.T, (r @ a.T).T).T / s  # (out, r)
            self.residual[key] = (r - s * carry @ a).float()
            b64 = b64 + carry
        return a, b64.float()

    def _carry_dense(self, key: str, delta: torch.Tensor) -> torch.Tensor:
        value = delta.detach().to(device="cpu", dtype=torch.float32)
        r = self._stored(key, tuple(value.shape))
        if r is None:
            return value
        del self.residual[key]  # replaced after encoding
        return (value.double() + r).float()

    def _stored(self, key: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        """The residual of `key` as float64, or None; a residual of another shape (a different
        base model) is dropped."""
        r = self.residual.get(key)
        if r is None:
            return None
        if tuple(r.shape) != shape:
            log.warning(
                "%s: dropping a residual of shape %s, the update needs %s",
                key,
                tuple(r.shape),
                shape,
            )
            del self.residual[key]
            return None
        return r.double()

    def save(self, path: Path) -> None:
        """Write the residuals to `path` (safetensors, atomically); no residual removes it."""
        if not self.residual:
            path.unlink(missing_ok=True)
            return
        write_atomic(path, safetensors_bytes({k: v.contiguous() for k, v in self.residual.items()}))

    @classmethod
    def load(cls, path: Path, *, enabled: bool = True) -> FfaErrorFeedback:
        """The feedback saved at `path` (empty when there is none)."""
        return cls(load_file(path) if path.exists() else None, enabled=enabled)


def _capped(delta: Delta, max_norm: float) -> Delta:
    """`delta` scaled by ``min(1, max_norm / ||delta||_2)`` (unchanged when `max_norm` is 0)."""
    if max_norm <= 0:
        return delta
    norm = math.sqrt(sum(float(t.double().square().sum()) for t in delta.values()))
    if norm <= max_norm:
        return delta
    factor = max_norm / norm
    return {k: (t.double() * factor).float() for k, t in delta.items()}
