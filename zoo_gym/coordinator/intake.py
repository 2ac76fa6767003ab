"""Intake: where an untrusted upload becomes a ledger row.

Checks run cheapest first: who sent it, is it signed, is it for the open round and the current
base, is its size and hash what it claims, does its envelope describe exactly the tensors this
round trains. Every refusal of a known contributor is recorded with its reason, so the
contributor can see why it earned nothing.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from flwr.app import ConfigRecord, MetricRecord, RecordDict

from zoo_gym import ledger
from zoo_gym.compression import (
    EnvelopeError,
    EnvelopeHeader,
    NonFiniteUpdate,
    envelope_norm,
    inspect_envelope,
)
from zoo_gym.coordinator.authentication import registered_key
from zoo_gym.coordinator.metrics import CoordinatorMetrics
from zoo_gym.coordinator.privacy_claims import claimed_epsilon, stated_mechanism
from zoo_gym.core.delta import Layout
from zoo_gym.core.hashing import sha256_bytes
from zoo_gym.core.identity import node_id, verify
from zoo_gym.core.lora import is_carry
from zoo_gym.core.protocol import (
    SUBMISSION,
    TRAIN_METRICS,
    IntakeResult,
    SignedSubmission,
    Verdict,
    already_accepted_reason,
)
from zoo_gym.ledger import Engine, Session
from zoo_gym.ledger.models import MAX_INT64

log = logging.getLogger(__name__)


@dataclass
class OpenRound:
    """What intake needs to know about the round being collected."""

    number: int
    base_version: str
    layout: Layout
    deadline_ms: int
    codec: str = ""  # the codec the round's task names; "" accepts any
    carry_codec: str = ""  # the codec of its carried Bs (`is_carry`); "" = `codec`
    max_update_norm: float = 0.0  # the largest L2 norm an update may have; 0.0 = no bound
    accepting: bool = True
    accepted: set[str] = field(default_factory=set)


class Intake:
    """Checks submissions against `open_round` and records each decision in the ledger; an
    accepted payload is kept in `payload_dir` under its SHA-256."""

    def __init__(
        self,
        *,
        engine: Engine,
        payload_dir: Path,
        max_upload_bytes: int,
        max_submissions_per_round: int,
        metrics: CoordinatorMetrics | None = None,
    ) -> None:
        self.engine = engine
        self.payload_dir = payload_dir
        self.max_upload_bytes = max_upload_bytes
        self.max_submissions_per_round = max_submissions_per_round
        self.metrics = metrics
        self.open_round: OpenRound | None = None
        self.lock = threading.Lock()
        self._rounds: set[int] = set()  # round numbers the ledger is known to hold
        payload_dir.mkdir(parents=True, exist_ok=True)

    def payload_path(self, sha256: str) -> Path:
        return self.payload_dir / f"{sha256}.zgde"

    def receive(
        self, sub: SignedSubmission, payload: Path, content: RecordDict, *, node_id: int
    ) -> tuple[Verdict, RecordDict]:
        """Check `sub`, whose payload was spooled to `payload`, and record the decision.

        What takes time (the contributor's row, the signature, reading and hashing the bytes,
        one pass over the envelope's values, copying the payload into the payload directory
        under a temporary name) runs outside `lock`, so submissions are checked and copied
        side by side; under it the round is looked at again (it may have closed or moved on
        meanwhile), one contributor's second acceptance is refused, the copy is renamed into
        place and the decision is recorded. Returns the verdict and what the ServerApp sees: an
        `IntakeResult` record beside the training metrics of `content`.
        """
        checked = self.open_round
        reason, envelope = self._first_look(sub, payload, node_id, checked)
        staged = None if reason or envelope else self._stage(payload)
        try:
            with self.lock:
                verdict = self._decide(sub, payload, content, checked, reason, envelope, staged)
        finally:
            if staged is not None:
                staged.unlink(missing_ok=True)  # refused: the copy goes (accepted: renamed)
        metrics = content.metric_records.get(TRAIN_METRICS, MetricRecord())
        result = ConfigRecord(IntakeResult.of(sub, verdict).to_record())
        return verdict, RecordDict({SUBMISSION: result, TRAIN_METRICS: metrics})

    def _stage(self, payload: Path) -> Path:
        """A copy of `payload` in the payload directory under a unique temporary name (a
        ``.part`` file, which `serve` clears at start if a crash left it)."""
        staged = self.payload_dir / f"{uuid.uuid4().hex}.part"
        shutil.copyfile(payload, staged)
        return staged

    def _first_look(
        self, sub: SignedSubmission, payload: Path, node: int, checked: OpenRound | None
    ) -> tuple[str, str]:
        """(why `sub` is refused, why its envelope does not fit `checked`): the checks that take
        time, made outside the lock; empty strings where nothing is wrong."""
        reason = self._sender_reason(sub, node) or self._round_reason(sub, checked)
        if reason:
            return reason, ""
        assert checked is not None
        data = payload.read_bytes()
        if len(data) != sub.payload_size or sha256_bytes(data) != sub.payload_sha256:
            return "payload size or SHA-256 differs from the signed statement", ""
        return "", envelope_reason(data, checked)

    def _decide(
        self,
        sub: SignedSubmission,
        payload: Path,
        content: RecordDict,
        checked: OpenRound | None,
        reason: str,
        envelope: str,
        staged: Path | None,
    ) -> Verdict:
        """Under `lock`: the round as it is now (it may have closed, passed its deadline or
        moved on since the first look), then the decision, recorded. `reason` and `envelope`
        are what the first look found against `checked`; `staged` is the payload's copy made
        then (None when the first look refused it)."""
        current = self.open_round
        reason = reason or self._round_reason(sub, current)
        if not reason and current is not checked:  # a new round opened: check against it
            assert current is not None
            envelope = envelope_reason(payload.read_bytes(), current)
        if not reason and current is not None and sub.contributor_id in current.accepted:
            reason = already_accepted_reason(sub.round)
        reason = reason or envelope
        if reason:
            return self.refuse(sub, reason)
        if staged is not None:
            os.replace(staged, self.payload_path(sub.payload_sha256))  # a rename, not a copy
        else:  # refused against the round it was first checked with, fits the one open now
            shutil.copyfile(payload, self.payload_path(sub.payload_sha256))
        verdict = self._record(
            sub,
            accepted=True,
            reason="accepted at intake",
            epsilon=claimed_epsilon(content),
            dp=stated_mechanism(content),
        )
        self._observe(verdict)
        if verdict.accepted and current is not None:
            current.accepted.add(sub.contributor_id)
        return verdict

    def refuse(self, sub: SignedSubmission, reason: str) -> Verdict:
        """Record a rejection that happened before the payload was read."""
        verdict = self._record(sub, accepted=False, reason=reason)
        log.info("rejected %s round %d: %s", sub.contributor_id[:12], sub.round, verdict.reason)
        self._observe(verdict)
        return verdict

    def _observe(self, verdict: Verdict) -> None:
        if self.metrics is not None:
            self.metrics.observe_submission(accepted=verdict.accepted, reason=verdict.reason)

    def _sender_reason(self, sub: SignedSubmission, node: int) -> str:
        key, status, _ = registered_key(self.engine, sub.contributor_id)
        if node_id(key) != node:
            return "submission names a different contributor than the one that sent it"
        if status != "active":
            return f"contributor is {status}"
        if not verify(key, sub.signature, sub.statement()):
            return "submission signature does not match your key; it was altered or signed with another key"
        return ""

    def _round_reason(self, sub: SignedSubmission, current: OpenRound | None) -> str:
        if current is None or not current.accepting:
            return f"round {sub.round} is not open for submissions; wait for the next task"
        if sub.round != current.number:
            return f"submission is for round {sub.round} but round {current.number} is open (stale round); train on the current task"
        if sub.base_version != current.base_version:
            return f"update was trained on {sub.base_version[:64]!r} but round {current.number} builds on {current.base_version} (stale base); fetch the current model"
        if current.deadline_ms and time.time() * 1000 > current.deadline_ms:
            return f"round {current.number} closed for submissions at its deadline"
        if sub.payload_size > self.max_upload_bytes:
            return (
                f"update of {sub.payload_size} bytes exceeds the {self.max_upload_bytes}-byte limit"
            )
        return ""

    def _record(
        self,
        sub: SignedSubmission,
        *,
        accepted: bool,
        reason: str,
        epsilon: float | None = None,
        dp: ledger.DpMechanism | None = None,
    ) -> Verdict:
        """File the decision under the round `sub` names (the latest one when that round is not
        in the ledger); past `max_submissions_per_round` a submission is refused, and only the
        first one over the limit is recorded."""
        with Session(self.engine) as session:
            round_number = self._filed_under(session, sub.round)
            if round_number == 0:
                return Verdict(False, reason)
            limit = self.max_submissions_per_round
            made = ledger.count_submissions(
                session, round_number=round_number, contributor_id=sub.contributor_id
            )
            if made >= limit:
                # the first one over the limit is recorded (so the contributor sees why); later
                # ones are not, so a flood of submissions cannot grow the ledger
                accepted = False
                reason = (
                    f"more than {limit} submissions from you for round {round_number}; "
                    "the rest are refused, wait for the next round"
                )
                if made > limit:
                    return Verdict(False, reason)
            try:
                row = ledger.record_submission(
                    session,
                    round_number=round_number,
                    contributor_id=sub.contributor_id,
                    nonce=sub.nonce.hex()[:128],
                    base_version=sub.base_version[:64],
                    payload_sha256=sub.payload_sha256[:64],
                    size_bytes=min(sub.payload_size, MAX_INT64),  # a claimed size, capped
                    decision="accepted" if accepted else "rejected",
                    reason=reason,
                    epsilon=epsilon,
                    dp=dp,
                )
            except ledger.ReplayedNonce:
                return Verdict(
                    False,
                    "this submission's nonce was already used (a replay); each submission needs a fresh nonce",
                )
            except ledger.DuplicateSubmission:
                return Verdict(False, already_accepted_reason(sub.round))
            return Verdict(accepted, reason, int(row.id or 0))

    def _filed_under(self, session: Session, number: int) -> int:
        """The round a submission naming round `number` is filed under: that one when the ledger
        has it (remembered: rounds are never deleted), else the latest (0: none yet)."""
        if number in self._rounds:
            return number
        if ledger.get_round(session, number=number) is not None:
            self._rounds.add(number)
            return number
        latest = ledger.latest_round(session)
        return latest.number if latest is not None else 0


def envelope_reason(data: bytes, current: OpenRound) -> str:
    """Empty string when envelope `data` fits the open round, else why it does not.

    In order of cost: a valid header, exactly the round's tensors, the round's codec for
    every tensor (its carry codec for the carried Bs), then one pass over the values (a
    tensor at a time) for NaN / Inf and the L2 norm bound.
    """
    try:
        header = inspect_envelope(data, max_elements=sum(s.numel for s in current.layout))
    except EnvelopeError as exc:
        return f"update envelope is invalid: {exc}"
    if tuple((s.name, s.shape) for s in header.layout) != tuple(
        (s.name, s.shape) for s in current.layout
    ):
        return "update tensors (names or shapes) differ from what this round trains; use the task's LoRA settings"
    reason = _codec_reason(header, current)
    if reason:
        return reason
    try:
        norm = envelope_norm(data, header)
    except NonFiniteUpdate as exc:
        return f"update has NaN or Inf values ({exc}); send finite values"
    except EnvelopeError as exc:
        return f"update envelope is invalid: {exc}"
    bound = current.max_update_norm
    if bound > 0 and not norm <= bound:
        return (
            f"update L2 norm {norm:.4g} exceeds round {current.number}'s norm bound {bound:.4g}; "
            "send a smaller update (clipped to the task's clip_norm when it sets one)"
        )
    return ""


def _codec_reason(header: EnvelopeHeader, current: OpenRound) -> str:
    """Why a tensor of `header` is not in the open round's codec ("" when every one is): the
    carried Bs in its carry codec, the rest in its codec."""
    if not current.codec:
        return ""
    carry_codec = current.carry_codec or current.codec
    for section in header.sections:
        if is_carry(section.spec.name):
            if section.codec != carry_codec:
                return (
                    f"carried B {section.spec.name} is encoded with {section.codec} but round "
                    f"{current.number} asks for {carry_codec}; compress the carried Bs with the "
                    "task's carry_codec"
                )
        elif section.codec != current.codec:
            return (
                f"update is encoded with {section.codec} but round {current.number} asks for "
                f"{current.codec}; compress it with the task's codec"
            )
    return ""
