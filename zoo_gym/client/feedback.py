"""Client-side error feedback for FFA-LoRA B updates and for dense weight deltas.

1-bit compression loses most of an update's magnitude detail; error feedback keeps
what was not transmitted and sends it later (Seide et al., 2014; Karimireddy et
al., 2019 "EF-SGD"). Every residual lives in the space of what is sent, so it is no
larger than the float32 update:

- FFA-LoRA B matrices (keys ending in ``.lora_B``): the residual e `(out, r)` is in
  B-space, for the frozen A its `a_seed` names. While A stays (the coordinator keeps
  one A for ``lora_a_rounds`` rounds) the update sent is C(B + e) and
  e ← (B + e) - C(B + e): nothing is lost, the sum of what was sent is the sum of
  the updates minus the last residual. When A changes (a new epoch of A, a new rank)
  the weight-space residual s·e·A_old is carried onto the new A by least squares:

      B_carry = e · (A_old A_newᵀ) · (A_new A_newᵀ)⁻¹        (out, r)

  formed from r x r Gram matrices, never an (out, in) matrix. What is lost is
  s·e·A_old·(I - P_new), the part outside the new A's row space (P_new projects onto
  it); for an A drawn independently of e the carry keeps about r / in of the
  residual's squared norm, so a change of A drops nearly all of one round's
  compression error. `last_change` reports the norms (`ChangeOfA`).
- Any other key (a dense weight delta such as ``model.layers.0.mlp.up_proj.weight``):
  the plain residual e of its own shape, sent as C(delta + e) with
  e ← delta + e - C(delta + e).

Residuals stay on the update's device, in float32. They are saved with the client's
state (`save` / `load`, safetensors with the A seed in its metadata), so they survive
a restart. ``enabled=False`` sends C(delta) and keeps nothing (for comparisons).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from safetensors.torch import save as safetensors_bytes

from zoo_gym.compression import CodecSpec, decode, encode
from zoo_gym.core.delta import Delta
from zoo_gym.core.files import write_atomic
from zoo_gym.core.lora import LoraSpec, frozen_a

SUFFIX = ".lora_B"
FORMAT = "zoo-gym/error-feedback"
VERSION = 2
"""Version 2: FFA residuals in B-space `(out, r)` for the A of ``a_seed`` (metadata).
Version 1 files (no metadata) hold weight-space `(out, in)` residuals; they are carried onto
the next round's A by least squares once, like a change of A."""
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChangeOfA:
    """What carrying the FFA residuals onto a new A kept and lost, in weight space.

    Norms are Frobenius norms over all modules: `residual` = ||s·e·A_old||, `carried` =
    ||s·B_carry·A_new||, `dropped` = ||s·e·A_old·(I - P_new)|| (so residual² = carried² +
    dropped²), and `update` = ||s·B·A_new|| of the round's own update, before any residual.
    """

    old_seed: int | None
    new_seed: int
    residual: float
    carried: float
    dropped: float
    update: float

    @property
    def dropped_share(self) -> float:
        """`dropped` relative to the round's update (0 when the update is 0)."""
        return self.dropped / self.update if self.update > 0 else 0.0


@dataclass(frozen=True)
class FeedbackSummary:
    """What a saved residual holds, read from its file's header (`summary`)."""

    residual_bytes: int
    update_bytes: int
    a_seed: int | None
    a_since: int
    round: int


class FfaErrorFeedback:
    """Residual per update key (float32, on the update's device); `enabled` switches error
    feedback on or off. `a_seed` names the frozen A the ``.lora_B`` residuals belong to,
    `a_since` the first round compressed under it, `round` the last one."""

    def __init__(
        self,
        residual: Mapping[str, torch.Tensor] | None = None,
        *,
        enabled: bool = True,
        a_seed: int | None = None,
        a_since: int = 0,
        round: int = 0,
        update_bytes: int = 0,
    ) -> None:
        self.enabled = enabled
        self.residual: dict[str, torch.Tensor] = dict(residual or {}) if enabled else {}
        self.a_seed = a_seed
        self.a_since, self.round = a_since, round
        self.update_bytes = update_bytes  # float32 bytes of the last update compressed
        self.last_change: ChangeOfA | None = None  # of the last compress, None: A stayed

    def compress(
        self,
        update: Delta,
        codec: CodecSpec,
        *,
        lora: LoraSpec | None = None,
        seed: int = 0,
        in_features: Mapping[str, int] | None = None,
        max_norm: float = 0.0,
        round: int = 0,
    ) -> tuple[bytes, Delta]:
        """Encode `update` plus the carried residuals; keep the new residuals.

        `lora`, `seed` (the seed of the round's frozen A) and `in_features` (module -> A's
        input size) are needed only for ``.lora_B`` keys. With `max_norm` > 0 the compensated
        update is scaled down to that L2 norm before encoding and what was removed stays in
        the residual (sent later), so the coordinator's norm bound
        (`zoo_gym.compression.feedback_cap`) admits it. `round` is recorded for `summary`.
        Returns (payload, the delta the coordinator will decode).
        """
        self.update_bytes = sum(t.numel() * 4 for t in update.values())
        if not self.enabled:
            payload = encode(update, codec)
            return payload, decode(payload, max_elements=sum(t.numel() for t in update.values()))
        ffa = [key for key in update if key.endswith(SUFFIX)]
        self.last_change = None
        if ffa:
            if lora is None or in_features is None:
                raise ValueError(f"{ffa[0]}: FFA-LoRA keys need `lora` and `in_features`")
            self.last_change = self._change_a(update, ffa, lora, seed, in_features)
        compensated = {key: self._compensated(key, value) for key, value in update.items()}
        payload = encode(_capped(compensated, max_norm), codec)
        sent = decode(payload, max_elements=sum(t.numel() for t in compensated.values()))
        for key, value in compensated.items():
            self.residual[key] = value - sent[key].to(value.device)  # float32, exact enough
        if ffa and seed != self.a_seed:
            self.a_seed, self.a_since = seed, round
        self.round = round
        return payload, sent

    def _compensated(self, key: str, delta: torch.Tensor) -> torch.Tensor:
        """`delta` plus the residual of `key` (float32 on `delta`'s device)."""
        value = delta.detach().float()
        r = self.residual.get(key)
        if r is None:
            return value
        if tuple(r.shape) != tuple(value.shape):
            log.warning(
                "%s: dropping a residual of shape %s, the update needs %s",
                key,
                tuple(r.shape),
                tuple(value.shape),
            )
            del self.residual[key]
            return value
        return value + r.to(device=value.device, dtype=torch.float32)

    def _change_a(
        self,
        update: Delta,
        keys: list[str],
        lora: LoraSpec,
        seed: int,
        in_features: Mapping[str, int],
    ) -> ChangeOfA | None:
        """Carry every FFA residual that belongs to another A (or rank) onto the A of `seed`,
        in place; None when every residual already belongs to it."""
        total = kept = update_sq = 0.0
        changed = False
        for key in keys:
            norms = self._carry_key(key, update[key], lora, seed, in_features)
            if norms is not None:
                total, kept, update_sq = total + norms[0], kept + norms[1], update_sq + norms[2]
                changed = True
        if not changed:
            return None
        change = ChangeOfA(
            old_seed=self.a_seed,
            new_seed=seed,
            residual=math.sqrt(total),
            carried=math.sqrt(max(kept, 0.0)),
            dropped=math.sqrt(max(total - kept, 0.0)),
            update=math.sqrt(update_sq),
        )
        log.info(
            "frozen A changed: carried %.3g of the residual's %.3g onto the new A; %.3g "
            "(%.1f%% of this round's update) is outside its row space and dropped",
            change.carried,
            change.residual,
            change.dropped,
            100 * change.dropped_share,
        )
        return change

    def _carry_key(
        self,
        key: str,
        b: torch.Tensor,
        lora: LoraSpec,
        seed: int,
        in_features: Mapping[str, int],
    ) -> tuple[float, float, float] | None:
        """Carry `key`'s residual onto the A of `seed` when it belongs to another A; (squared
        norms of the residual, of what was carried, of this round's update) or None."""
        r = self.residual.get(key)
        out, rank = int(b.shape[0]), int(b.shape[1])
        if r is None or (self.a_seed == seed and tuple(r.shape) == (out, rank)):
            return None
        s, module, device = lora.scaling, key.removesuffix(SUFFIX), b.device
        a_new = frozen_a(seed, module, in_features[module], rank).to(device, torch.float64)
        g_nn = a_new @ a_new.T  # (r, r)
        if tuple(r.shape) == (out, in_features[module]):  # a version 1 weight-space residual
            w = r.to(device, torch.float64)  # (out, in)
            cross = (w @ a_new.T) / s  # (out, r)
            carry = _solve(cross, g_nn)
            total, kept = float(w.square().sum()), s * s * float((cross * carry).sum())
        elif r.shape[0] == out and self.a_seed is not None:
            a_old = frozen_a(self.a_seed, module, in_features[module], int(r.shape[1]))
            carry, total, kept = least_squares_carry(
                r.to(device), a_old.to(device), a_new, scaling=s
            )
        else:
            log.warning("%s: dropping a residual of shape %s for an unknown A", key, tuple(r.shape))
            del self.residual[key]
            return None
        b64 = b.detach().to(device, torch.float64)
        self.residual[key] = carry.float()
        return total, kept, s * s * float(((b64 @ g_nn) * b64).sum())

    def nbytes(self) -> int:
        """Bytes the residuals hold."""
        return sum(t.numel() * t.element_size() for t in self.residual.values())

    def save(self, path: Path) -> None:
        """Write the residuals to `path` (safetensors, atomically); no residual removes it."""
        if not self.residual:
            path.unlink(missing_ok=True)
            return
        metadata = {
            "format": FORMAT,
            "version": str(VERSION),
            "round": str(self.round),
            "a_since": str(self.a_since),
            "update_bytes": str(self.update_bytes),
        }
        if self.a_seed is not None:
            metadata["a_seed"] = str(self.a_seed)
        tensors = {k: v.detach().cpu().contiguous() for k, v in self.residual.items()}
        write_atomic(path, safetensors_bytes(tensors, metadata=metadata))

    @classmethod
    def load(cls, path: Path, *, enabled: bool = True) -> FfaErrorFeedback:
        """The feedback saved at `path` (empty when there is none)."""
        if not path.exists():
            return cls(enabled=enabled)
        meta = _metadata(path)
        return cls(
            load_file(path),
            enabled=enabled,
            a_seed=int(meta["a_seed"]) if "a_seed" in meta else None,
            a_since=int(meta.get("a_since", 0)),
            round=int(meta.get("round", 0)),
            update_bytes=int(meta.get("update_bytes", 0)),
        )


def summary(path: Path) -> FeedbackSummary | None:
    """What the residual saved at `path` holds, from its header alone (None: no file)."""
    if not path.exists():
        return None
    meta = _metadata(path)
    size = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
    residual_bytes = 0
    with safe_open(path, framework="pt") as f:
        for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            piece = f.get_slice(key)
            residual_bytes += math.prod(piece.get_shape()) * size.get(piece.get_dtype(), 4)
    return FeedbackSummary(
        residual_bytes=residual_bytes,
        update_bytes=int(meta.get("update_bytes", 0)),
        a_seed=int(meta["a_seed"]) if "a_seed" in meta else None,
        a_since=int(meta.get("a_since", 0)),
        round=int(meta.get("round", 0)),
    )


def _metadata(path: Path) -> dict[str, str]:
    with safe_open(path, framework="pt") as f:
        return dict(f.metadata() or {})


def least_squares_carry(
    e: torch.Tensor, a_old: torch.Tensor, a_new: torch.Tensor, *, scaling: float
) -> tuple[torch.Tensor, float, float]:
    """Carry a B-space residual `e` `(out, r_old)` of A `a_old` `(r_old, in)` onto `a_new`
    `(r_new, in)`: the B `(out, r_new)` minimising ||s·e·A_old - s·B·A_new||_F, which is

        B = e · (A_old A_newᵀ) · (A_new A_newᵀ)⁻¹,

    with ||s·e·A_old||² and ||s·B·A_new||² (their difference is the squared norm of what the
    carry drops: the part of s·e·A_old outside the row space of A_new). Formed from the
    `(r_old, r_new)` and `(r_new, r_new)` Gram matrices in float64, never an (out, in) matrix.
    """
    e, a_old, a_new = e.double(), a_old.double(), a_new.double()
    cross = e @ (a_old @ a_new.T)  # (out, r_new)
    carry = _solve(cross, a_new @ a_new.T)
    s2 = scaling * scaling
    total = s2 * float(((e @ (a_old @ a_old.T)) * e).sum())
    return carry, total, s2 * float((cross * carry).sum())  # ||s·B·A_new||² = s²·tr(cross·Bᵀ)


def _solve(cross: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """cross · gram⁻¹ `(out, r)` for a symmetric positive definite `gram` `(r, r)`."""
    solution: torch.Tensor = torch.linalg.solve(gram, cross.T)
    return solution.T


def _capped(delta: Delta, max_norm: float) -> Delta:
    """`delta` scaled by ``min(1, max_norm / ||delta||_2)`` (unchanged when `max_norm` is 0)."""
    if max_norm <= 0:
        return delta
    norm = math.sqrt(sum(float(t.double().square().sum()) for t in delta.values()))
    if norm <= max_norm:
        return delta
    factor = max_norm / norm
    return {k: (t.double() * factor).float() for k, t in delta.items()}
