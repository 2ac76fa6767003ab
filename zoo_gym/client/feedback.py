"""Client-side error feedback for FFA-LoRA B updates and for dense weight deltas.

1-bit compression loses most of an update's magnitude detail; error feedback keeps
what was not transmitted and sends it later (Seide et al., 2014; Karimireddy et
al., 2019 "EF-SGD"). Every residual lives in the space of what is sent, so it is no
larger than the float32 update:

- FFA-LoRA B matrices (keys ending in ``.lora_B``): the residual e `(out, r)` is in
  B-space, for the frozen A its `a_seed` names. While A stays (the coordinator keeps
  one A for ``lora_a_rounds`` rounds) the update sent is C(B + e) and
  e ← (B + e) - C(B + e): nothing is lost, the sum of what was sent is the sum of
  the updates minus the last residual. The first round of a new epoch of A (the
  task's ``carry_a_seed`` names the previous A) sends e back against the A it belongs
  to: the update is C(B) and, per module, a carried B C'(e) (``.lora_B_carry``, in the
  same envelope, compressed with the round's carry codec C', `compression.spec.carry_spec`), which the
  coordinator merges as s·(C(B)·A_new + C'(e)·A_old). What that loses is only the
  carry's own compression error q = e - C'(e): it is carried onto the new A by least
  squares,

      B_ls = q · (A_old A_newᵀ) · (A_new A_newᵀ)⁻¹        (out, r)

  formed from r x r Gram matrices, never an (out, in) matrix, and joins the new
  residual (B - C(B)) + B_ls, so the residual stays B-sized (the upload of that round
  is two B-sized tensors per module). Dropped is s·q·A_old·(I - P_new), the part of q
  outside the new A's row space (P_new projects onto it; for an A drawn independently
  of q it keeps about r / in of the squared norm). With BitDelta as C' q is the 1-bit
  error of e, about 0.6 of its norm: a change of A drops 0.6-0.7 of what carrying e
  itself by least squares dropped; with int8 (the coordinator's default carry codec)
  q is the rounding error of 8-bit codes, and with ``none`` (float32) q = 0 and
  nothing is dropped (bench/README.md). A residual that belongs to another A
  (the client took part in no round of the previous epoch, the rank changed, a
  version 1 file) cannot be sent back: the carried B is zero and e itself is carried
  by least squares, as it is when A changes outside a first round of an epoch (a
  policy change of ``lora_a_rounds``). `last_change` reports the norms (`ChangeOfA`).
- Any other key (a dense weight delta such as ``model.layers.0.mlp.up_proj.weight``):
  the plain residual e of its own shape, sent as C(delta + e) with
  e ← delta + e - C(delta + e).

Residuals stay on the update's device, in float32. They are saved with the client's
state (`save` / `load`, safetensors with the A seed in its metadata), so they survive
a restart; a client restarted before the first round of an epoch sends the saved
residual back as that round's carried B. A carry round leaves no carried residual
behind, so the file format is unchanged (version 2). ``enabled=False`` sends C(delta)
(and zero carried Bs where the round wants them) and keeps nothing (for comparisons).
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
from zoo_gym.core.lora import LoraSpec, carry_key, frozen_a, module_of, update_key

SUFFIX = ".lora_B"
FORMAT = "zoo-gym/error-feedback"
VERSION = 2
"""Version 2: FFA residuals in B-space `(out, r)` for the A of ``a_seed`` (metadata).
Version 1 files (no metadata) hold weight-space `(out, in)` residuals; they are carried onto
the next round's A by least squares once, like a change of A."""
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChangeOfA:
    """What a change of A did with the FFA residuals, in weight space.

    Norms are Frobenius norms over all modules: `residual` = ||s·e·A_old|| pending at the
    change; `remainder` = ||s·q·A_old||, the part of it not sent against A_old (q = e - C(e)
    for a residual sent back as the round's carried B, the whole e when the round carries
    nothing back); `carried` = ||s·B_ls·A_new|| of the remainder's least-squares carry onto
    the new A and `dropped` = ||s·q·A_old·(I - P_new)|| (so remainder² = carried² +
    dropped²); `update` = ||s·B·A_new|| of the round's own update, before any residual.
    """

    old_seed: int | None
    new_seed: int
    residual: float
    remainder: float
    carried: float
    dropped: float
    update: float

    @property
    def dropped_share(self) -> float:
        """`dropped` relative to the round's update (0 when the update is 0)."""
        return self.dropped / self.update if self.update > 0 else 0.0


@dataclass
class _Tally:
    """Squared weight-space norms of a change of A, summed over modules (see `ChangeOfA`)."""

    residual: float = 0.0
    remainder: float = 0.0
    carried: float = 0.0
    changed: bool = False

    def add(self, residual: float, remainder: float, carried: float) -> None:
        self.residual += residual
        self.remainder += remainder
        self.carried += carried
        self.changed = True


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
        carry_seed: int | None = None,
        in_features: Mapping[str, int] | None = None,
        max_norm: float = 0.0,
        round: int = 0,
        carry_codec: CodecSpec | None = None,
    ) -> tuple[bytes, Delta]:
        """Encode `update` plus the carried residuals; keep the new residuals.

        `lora`, `seed` (the seed of the round's frozen A) and `in_features` (module -> A's
        input size) are needed only for ``.lora_B`` keys. `carry_seed` (the task's
        ``carry_a_seed``, set in the first round of an epoch of A) names the previous epoch's
        A: each ``.lora_B`` key then goes out with a ``.lora_B_carry`` (`carry_key`), the
        residual kept for that A (zeros when the residual belongs to another A, or there is
        none), compressed in the same envelope with `carry_codec` (None: `codec`). What its
        compression left is carried onto the new A by least squares and joins the new
        residual. With `max_norm` > 0 the compensated
        update is scaled down to that L2 norm before encoding and what was removed stays in
        the residual (sent later), so the coordinator's norm bound
        (`zoo_gym.compression.feedback_cap`) admits it. `round` is recorded for `summary`.
        Returns (payload, the delta the coordinator will decode).
        """
        self.update_bytes = sum(t.numel() * 4 for t in update.values())
        ffa = [key for key in update if key.endswith(SUFFIX)]
        if not self.enabled:
            zeros = _zero_carry(update, ffa, carry_seed)
            payload = encode({**update, **zeros}, codec, own=_own(zeros, carry_codec))
            d = sum(t.numel() for t in update.values()) + sum(t.numel() for t in zeros.values())
            return payload, decode(payload, max_elements=d)
        self.last_change = None
        tally = _Tally()
        if ffa and (lora is None or in_features is None):
            raise ValueError(f"{ffa[0]}: FFA-LoRA keys need `lora` and `in_features`")
        back = self._send_back(update, ffa, carry_seed)  # carry key -> residual for A_old
        for key in ffa:
            assert lora is not None and in_features is not None
            self._carry_key(key, update[key], lora, seed, in_features, tally)
        compensated = {key: self._compensated(key, value) for key, value in update.items()}
        compensated.update(back)
        payload = encode(_capped(compensated, max_norm), codec, own=_own(back, carry_codec))
        sent = decode(payload, max_elements=sum(t.numel() for t in compensated.values()))
        for key, value in update.items():
            self.residual[key] = compensated[key] - sent[key].to(value.device)  # float32
        for key, pending in back.items():
            assert lora is not None and in_features is not None and carry_seed is not None
            remainder = pending - sent[key].to(pending.device)
            self._fold(key, pending, remainder, lora, (carry_seed, seed), in_features, tally)
        if tally.changed:
            assert lora is not None and in_features is not None
            self.last_change = self._report(tally, update, ffa, lora, seed, in_features)
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

    def _send_back(
        self, update: Delta, keys: list[str], carry_seed: int | None
    ) -> dict[str, torch.Tensor]:
        """The carried Bs of a round that sends residuals back to the A of `carry_seed`: each
        `carry_key` -> the residual kept for that A, taken out of `residual` (zeros when the
        residual belongs to another A or rank, which `_carry_key` then carries onto the new
        A). Empty when the round carries nothing."""
        back = _zero_carry(update, keys, carry_seed)
        if carry_seed is None or self.a_seed != carry_seed:
            return back
        for key in keys:
            r = self.residual.get(key)
            if r is not None and tuple(r.shape) == tuple(update[key].shape):
                back[carry_key(module_of(key))] = self.residual.pop(key).to(update[key].device)
        return back

    def _carry_key(
        self,
        key: str,
        b: torch.Tensor,
        lora: LoraSpec,
        seed: int,
        in_features: Mapping[str, int],
        tally: _Tally,
    ) -> None:
        """Carry `key`'s residual onto the A of `seed` by least squares when it belongs to
        another A (or rank), in place; its norms go to `tally`."""
        r = self.residual.get(key)
        out, rank = int(b.shape[0]), int(b.shape[1])
        if r is None or (self.a_seed == seed and tuple(r.shape) == (out, rank)):
            return
        s, module, device = lora.scaling, module_of(key), b.device
        a_new = frozen_a(seed, module, in_features[module], rank).to(device, torch.float64)
        if tuple(r.shape) == (out, in_features[module]):  # a version 1 weight-space residual
            w = r.to(device, torch.float64)  # (out, in)
            cross = (w @ a_new.T) / s  # (out, r)
            carry = _solve(cross, a_new @ a_new.T)
            total, kept = float(w.square().sum()), s * s * float((cross * carry).sum())
        elif r.shape[0] == out and self.a_seed is not None:
            a_old = frozen_a(self.a_seed, module, in_features[module], int(r.shape[1]))
            carry, total, kept = least_squares_carry(
                r.to(device), a_old.to(device), a_new, scaling=s
            )
        else:
            log.warning("%s: dropping a residual of shape %s for an unknown A", key, tuple(r.shape))
            del self.residual[key]
            return
        self.residual[key] = carry.float()
        tally.add(total, total, kept)

    def _fold(
        self,
        key: str,
        pending: torch.Tensor,
        remainder: torch.Tensor,
        lora: LoraSpec,
        seeds: tuple[int, int],
        in_features: Mapping[str, int],
        tally: _Tally,
    ) -> None:
        """Carry `remainder` `(out, r)`, what compressing the carried B `pending` of `key`
        left, from the old A onto the new one (`seeds`) by least squares, into the residual
        of the module's B; the norms go to `tally`."""
        module, (old, new), rank = module_of(key), seeds, int(pending.shape[1])
        a_old = frozen_a(old, module, in_features[module], rank).to(pending.device)
        a_new = frozen_a(new, module, in_features[module], rank).to(pending.device)
        carry, rest, kept = least_squares_carry(remainder, a_old, a_new, scaling=lora.scaling)
        target = update_key(module)
        self.residual[target] = self.residual[target] + carry.float().to(pending.device)
        tally.add(_squared_norm(pending, a_old, lora.scaling), rest, kept)

    def _report(
        self,
        tally: _Tally,
        update: Delta,
        keys: list[str],
        lora: LoraSpec,
        seed: int,
        in_features: Mapping[str, int],
    ) -> ChangeOfA:
        """The `ChangeOfA` of `tally`, with the norm of the round's update; logged."""
        update_sq = 0.0
        for key in keys:
            module, b = module_of(key), update[key]
            a_new = frozen_a(seed, module, in_features[module], int(b.shape[1]))
            update_sq += _squared_norm(b, a_new.to(b.device), lora.scaling)
        change = ChangeOfA(
            old_seed=self.a_seed,
            new_seed=seed,
            residual=math.sqrt(tally.residual),
            remainder=math.sqrt(tally.remainder),
            carried=math.sqrt(max(tally.carried, 0.0)),
            dropped=math.sqrt(max(tally.remainder - tally.carried, 0.0)),
            update=math.sqrt(update_sq),
        )
        log.info(
            "frozen A changed: %.3g of the residual's %.3g was not sent against the old A; "
            "%.3g of that carried onto the new A, %.3g (%.1f%% of this round's update) is "
            "outside its row space and dropped",
            change.remainder,
            change.residual,
            change.carried,
            change.dropped,
            100 * change.dropped_share,
        )
        return change

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


def _squared_norm(b: torch.Tensor, a: torch.Tensor, scaling: float) -> float:
    """||s·b·a||² of `b` `(out, r)` and `a` `(r, in)`, from the `(r, r)` Gram matrix."""
    b64, a64 = b.detach().double(), a.double()
    return scaling * scaling * float(((b64 @ (a64 @ a64.T)) * b64).sum())


def _zero_carry(update: Delta, keys: list[str], carry_seed: int | None) -> dict[str, torch.Tensor]:
    """A zero `carry_key` tensor per FFA key (float32, the B's shape and device); empty when
    the round carries nothing (`carry_seed` None)."""
    if carry_seed is None:
        return {}
    return {
        carry_key(module_of(key)): torch.zeros(
            update[key].shape, dtype=torch.float32, device=update[key].device
        )
        for key in keys
    }


def _own(carried: Mapping[str, torch.Tensor], codec: CodecSpec | None) -> dict[str, CodecSpec]:
    """`codec` for every carried B (`encode`'s `own`); none when `codec` is None."""
    return {} if codec is None else dict.fromkeys(carried, codec)


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
