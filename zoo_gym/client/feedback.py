"""Error feedback for FFA-LoRA updates whose frozen A changes every round.

1-bit compression of B loses most of B's magnitude detail; error feedback keeps
what was not transmitted and sends it later (Seide et al., 2014; Karimireddy
et al., 2019 "EF-SGD"). Because each round's A is regenerated from that
round's seed, a residual in B-space would mean something else next round. So
the residual is kept in weight space, R = s·(B - B̂)·A (out, in), and carried
into the next round's B by least squares onto the new A:

    B_carry = R Aᵀ (A Aᵀ)⁻¹ / s,        R ← R - s·B_carry·A

The part of R outside the new A's row space stays in R for later rounds, so
nothing is dropped. Memory: one float32 (out, in) tensor per target module.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from zoo_gym.compression import CodecSpec, decode, encode
from zoo_gym.core.delta import Delta
from zoo_gym.core.lora import LoraSpec, frozen_a

SUFFIX = ".lora_B"


class FfaErrorFeedback:
    def __init__(self, residual: dict[str, torch.Tensor] | None = None) -> None:
        self.residual: dict[str, torch.Tensor] = dict(residual or {})

    def compress(
        self, update: Delta, codec: CodecSpec, *, lora: LoraSpec, seed: int, in_features: dict[str, int]
    ) -> tuple[bytes, Delta]:
        """Encode `update` plus the carried residual; keep the new residual."""
        s = lora.scaling
        frozen: dict[str, torch.Tensor] = {}
        compensated: Delta = {}
        for key, b in update.items():
            module = key.removesuffix(SUFFIX)
            a = frozen_a(seed, module, in_features[module], lora.rank).double()  # (r, in)
            frozen[key] = a
            b64 = b.double()
            if key in self.residual:
                r = self.residual[key].double()  # (out, in)
                carry = torch.linalg.solve(a @ a.T, (r @ a.T).T).T / s  # (out, r)
                self.residual[key] = (r - s * carry @ a).float()
                b64 = b64 + carry
            compensated[key] = b64.float()
        payload = encode(compensated, codec)
        sent = decode(payload, max_elements=sum(t.numel() for t in compensated.values()))
        for key, a in frozen.items():
            err = s * (compensated[key].double() - sent[key].double()) @ a  # (out, in)
            prev = self.residual.get(key)
            self.residual[key] = (err if prev is None else prev.double() + err).float()
        return payload, sent

    def save(self, path: Path) -> None:
        if self.residual:
            save_file({k: v.contiguous() for k, v in self.residual.items()}, path)

    @classmethod
    def load(cls, path: Path) -> FfaErrorFeedback:
        return cls(load_file(path) if path.exists() else None)
