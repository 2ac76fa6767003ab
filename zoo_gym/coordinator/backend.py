"""The coordinator's answers to contributors: registration, auth and intake.

Intake is where an untrusted upload becomes a ledger row. Checks run cheapest
first: who sent it, is it signed, is it for the open round and the current
base, is its size and hash what it claims, does its envelope describe exactly
the tensors this round trains. Every refusal of a known contributor is
recorded with its reason, so the contributor can see why it earned nothing.
"""

from __future__ import annotations

import logging
import math
import re
import shutil
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from flwr.app import ConfigRecord, MetricRecord, RecordDict

from zoo_gym import ledger
from zoo_gym.compression import EnvelopeError, NonFiniteUpdate, envelope_norm, inspect_envelope
from zoo_gym.coordinator.metrics import CoordinatorMetrics
from zoo_gym.coordinator.registry import ModelRegistry
from zoo_gym.coordinator.replay import NonceCache
from zoo_gym.core.delta import Layout
from zoo_gym.core.hashing import sha256_bytes
from zoo_gym.core.identity import CONTRIBUTOR_ID, Identity, contributor_id, node_id, verify
from zoo_gym.core.protocol import (
    CALL_NONCE_BYTES,
    SUBMISSION,
    TRAIN_METRICS,
    IntakeResult,
    Outcome,
    Registration,
    RequestError,
    SignedSubmission,
    Verdict,
    already_accepted_reason,
    register_statement,
    request_statement,
)
from zoo_gym.ledger import Engine, Session
from zoo_gym.ledger.models import MAX_INT64
from zoo_gym.transport.limits import TokenBuckets

log = logging.getLogger(__name__)


@dataclass
class OpenRound:
    """What intake needs to know about the round being collected."""

    number: int
    base_version: str
    layout: Layout
    deadline_ms: int
    codec: str = ""  # the codec the round's task names; "" accepts any
    max_update_norm: float = 0.0  # the largest L2 norm an update may have; 0.0 = no bound
    accepting: bool = True
    accepted: set[str] = field(default_factory=set)


IMPATIENCE_RATE_PER_S = 0.5
IMPATIENCE_BURST = 3
"""An address refused new keys faster than this (after a burst) loses the overall reserve:
one that asks again as soon as it is answered is (refusals are answered after the service's
refusal delay, 1 s by default), `gym-client`, which waits as told and then longer, is not."""


@dataclass(frozen=True)
class AdmissionPolicy:
    """Who may register a new key, and how fast new keys are taken.

    `admission`: "open" (active at once, at zero reputation), "approval" (pending until an
    operator approves) or "invite" (only with a valid invitation code). New keys are taken at
    most `rate_per_s` per second (bursts of `burst`) over all addresses and
    `per_address_rate_per_s` (bursts of `per_address_burst`) from one address; 0 = unlimited.
    A key already registered is answered without spending either allowance.

    The last `reserve` keys of the overall allowance go only to patient addresses: those that
    were not refused more than `IMPATIENCE_BURST` times at a pace faster than one refusal per
    2 s. A flood that keeps asking while refused is left what is above the reserve, and a
    newcomer who retries when told finds a key waiting for it.
    """

    admission: str = "open"
    rate_per_s: float = 1.0
    burst: int = 50
    per_address_rate_per_s: float = 0.1
    per_address_burst: int = 20
    reserve: int = 10


class CoordinatorBackend:
    def __init__(
        self,
        *,
        engine: Engine,
        registry: ModelRegistry,
        signer: Identity,
        payload_dir: Path,
        max_upload_bytes: int,
        clock_skew_s: float = 300.0,
        require_approval: bool = False,
        metrics: CoordinatorMetrics | None = None,
        max_submissions_per_round: int = 3,
        admission: AdmissionPolicy | None = None,
        nonces: NonceCache | None = None,
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.registry = registry
        self.signer = signer
        self.payload_dir = payload_dir
        self.max_upload_bytes = max_upload_bytes
        self.clock_skew_s = clock_skew_s
        # single use of each signed call; remembered as long as its timestamp passes _check_clock
        self.nonces = nonces or NonceCache(clock_skew_s)
        self.max_submissions_per_round = max_submissions_per_round
        self.admission = AdmissionPolicy() if admission is None else admission
        if require_approval:
            self.require_approval = True
        self.lock = threading.Lock()
        self._known: set[str] | None = None
        self._known_lock = threading.Lock()
        self.open_round: OpenRound | None = None
        payload_dir.mkdir(parents=True, exist_ok=True)

    @property
    def admission(self) -> AdmissionPolicy:
        return self._admission

    @admission.setter
    def admission(self, policy: AdmissionPolicy) -> None:
        self._admission = policy
        self._new_keys = TokenBuckets(policy.rate_per_s, policy.burst, max_keys=1)
        self._new_keys_by_address = TokenBuckets(
            policy.per_address_rate_per_s, policy.per_address_burst
        )
        self._impatience = TokenBuckets(IMPATIENCE_RATE_PER_S, IMPATIENCE_BURST)

    @property
    def require_approval(self) -> bool:
        """Whether new keys wait for an operator (admission "approval")."""
        return self._admission.admission == "approval"

    @require_approval.setter
    def require_approval(self, value: bool) -> None:
        if value != self.require_approval:
            self._admission = replace(self._admission, admission="approval" if value else "open")

    # -- identity ---------------------------------------------------------
    def _check_clock(self, timestamp_ms: int) -> None:
        skew = timestamp_ms / 1000 - time.time()
        if abs(skew) > self.clock_skew_s:
            raise RequestError(
                "UNAUTHENTICATED",
                f"your clock is {abs(skew):.0f} s {'ahead of' if skew > 0 else 'behind'} the coordinator's "
                f"(limit {self.clock_skew_s:.0f} s); "
                "synchronise it (e.g. enable NTP) and retry",
            )

    def register(
        self,
        *,
        public_key: bytes,
        name: str,
        timestamp_ms: int,
        signature: bytes,
        invite: str = "",
        peer: str | None = None,
    ) -> Registration:
        """Register a key under the admission policy; a known key is answered as it stands.

        Checks run cheapest first and nothing is written for a refused key: a new key while
        the allowances for new keys are spent (refused from memory, before the signature or
        the database: this is what a registration flood meets), the signature, a known key
        (answered without spending any allowance), an invitation code's presence, the
        per-address and global allowances (spent only by callers over the network, `peer` not
        None), then the code itself.
        """
        if len(public_key) != 32:
            raise RequestError("INVALID_ARGUMENT", "public key must be a raw 32-byte Ed25519 key")
        self._check_clock(timestamp_ms)
        cid = contributor_id(public_key)
        if peer is not None and cid not in self._known_ids():
            self._allowance(peer, spend=False)
        if not verify(public_key, signature, register_statement(public_key, name, timestamp_ms)):
            raise RequestError(
                "UNAUTHENTICATED",
                "registration signature does not match the key; check your key file",
            )
        with Session(self.engine) as session:
            known = ledger.get_contributor(session, contributor_id=cid)
            if known is not None and bytes(known.public_key) == bytes(public_key):
                status = known.status
            else:
                status = self._admit(session, cid, public_key, name[:64], invite, peer)
        return Registration(
            cid, node_id(public_key), status, self.current_version(), self.signer.public_key
        )

    def _admit(
        self,
        session: Session,
        cid: str,
        public_key: bytes,
        name: str,
        invite: str,
        peer: str | None,
    ) -> str:
        """Write a new contributor row if the policy admits it; its status."""
        policy = self._admission
        if policy.admission == "invite" and not invite:
            raise RequestError(
                "PERMISSION_DENIED",
                "this coordinator admits new keys by invitation only; "
                "ask the operator for a code and join with --invite CODE",
            )
        if peer is not None:
            self._allowance(peer, spend=True)
        status = "pending" if policy.admission == "approval" else "active"
        try:
            if policy.admission == "invite":
                row = ledger.register_with_invite(
                    session,
                    code=invite[:256],
                    contributor_id=cid,
                    public_key=public_key,
                    name=name,
                    status=status,
                )
            else:
                row = ledger.register_contributor(
                    session, contributor_id=cid, public_key=public_key, name=name, status=status
                )
        except ledger.InviteRefused as exc:
            raise RequestError("PERMISSION_DENIED", str(exc)) from None
        self._known_ids().add(cid)
        return row.status

    def _known_ids(self) -> set[str]:
        """Every registered key's id, read from the ledger once; rows are never deleted, and
        every key admitted here is added."""
        with self._known_lock:
            if self._known is None:
                with Session(self.engine) as session:
                    self._known = ledger.contributor_ids(session)
            return self._known

    def _allowance(self, peer: str, *, spend: bool) -> None:
        """Refuse a new key when `peer`'s allowance or the global one is empty (the reserve
        counts as empty for an impatient `peer`); with `spend` take one new key from each."""
        by_address, overall = self._new_keys_by_address, self._new_keys
        wait = by_address.take(peer) if spend else by_address.wait(peer)
        if wait > 0:
            self._impatience.take(peer)
            raise RequestError(
                "RESOURCE_EXHAUSTED",
                f"too many new keys registered from your address just now; retry in {max(1.0, wait):.0f} s",
            )
        keep = self._admission.reserve if self._impatience.wait(peer) > 0 else 0
        wait = overall.take("", keep=keep) if spend else overall.wait("", keep=keep)
        if wait > 0:
            self._impatience.take(peer)
            raise RequestError(
                "RESOURCE_EXHAUSTED",
                f"too many new keys registered just now (the coordinator takes "
                f"{self._admission.rate_per_s:g} per second); retry in {max(1.0, wait):.0f} s",
            )

    def _contributor(self, cid: str) -> tuple[bytes, str, str]:
        if not re.fullmatch(CONTRIBUTOR_ID, cid):
            raise RequestError(
                "UNAUTHENTICATED",
                "contributor id must be the 32 hex digits derived from your key; use the id `gym-client init` printed",
            )
        with Session(self.engine) as session:
            row = ledger.get_contributor(session, contributor_id=cid)
            if row is None:
                raise RequestError(
                    "UNAUTHENTICATED",
                    f"contributor {cid[:12]} is not registered here; run `gym-client join` to register your key",
                )
            key = (
                row.public_key
                if isinstance(row.public_key, bytes)
                else bytes.fromhex(row.public_key)
            )
            return key, row.status, row.status_reason or ""

    def authenticate(
        self,
        *,
        method: str,
        contributor_id: str,
        timestamp_ms: int,
        nonce: bytes,
        digest: str,
        signature: bytes,
    ) -> int:
        """Check a signed call, cheapest first, and spend its nonce once the signature verified."""
        if not nonce:
            raise RequestError(
                "UNAUTHENTICATED",
                "this client does not send per-call nonces; upgrade zoo-gym",
            )
        if len(nonce) != CALL_NONCE_BYTES:
            raise RequestError(
                "UNAUTHENTICATED",
                f"a call's nonce must be {CALL_NONCE_BYTES} random bytes, not {len(nonce)}; "
                "send a fresh one with every call",
            )
        key, status, reason = self._contributor(contributor_id)
        statement = request_statement(method, contributor_id, timestamp_ms, nonce, digest)
        if not verify(key, signature, statement):
            raise RequestError(
                "UNAUTHENTICATED",
                "request signature does not match your registered key; use the key you registered with",
            )
        self._check_clock(timestamp_ms)
        # only a verified call is remembered, so strangers cannot fill the cache
        if not self.nonces.admit(contributor_id, nonce, timestamp_ms):
            raise RequestError(
                "UNAUTHENTICATED",
                "replayed request: this call's nonce was used before (or the call is older than "
                "replays can still be told apart); make it again with a fresh nonce and timestamp",
            )
        if status == "banned":
            raise RequestError(
                "PERMISSION_DENIED",
                f"this key is banned ({reason or 'no reason given'}); contact the operator",
            )
        if status == "pending" and method != "outcome":
            raise RequestError(
                "PERMISSION_DENIED", "your registration awaits operator approval; try again later"
            )
        return node_id(key)

    # -- models -------------------------------------------------------------
    def current_version(self) -> str:
        try:
            return self.registry.latest().version
        except FileNotFoundError:
            return ""

    def manifest(self, version: str) -> tuple[bytes, bytes]:
        try:
            directory = self.registry.directory(version)
        except KeyError:
            raise _not_published(version) from None
        return (directory / "manifest.json").read_bytes(), (directory / "manifest.sig").read_bytes()

    def model_file(self, version: str, name: str) -> Path:
        try:
            published = self.registry.get(version)
        except KeyError:
            raise _not_published(version) from None
        if name not in published.manifest.files:
            raise RequestError("NOT_FOUND", f"{name!r} is not a file of {version}")
        return published.directory / name

    # -- intake -------------------------------------------------------------
    def _record(
        self,
        sub: SignedSubmission,
        *,
        accepted: bool,
        reason: str,
        epsilon: float | None = None,
        dp: ledger.DpMechanism | None = None,
    ) -> Verdict:
        with Session(self.engine) as session:
            round_number = sub.round
            if ledger.get_round(session, number=round_number) is None:
                latest = ledger.latest_round(session)
                round_number = latest.number if latest is not None else 0
            if round_number == 0:
                return Verdict(False, reason)
            limit = self.max_submissions_per_round
            made = len(
                ledger.list_submissions(
                    session, round_number=round_number, contributor_id=sub.contributor_id
                )
            )
            if made >= limit:
                # the first one over the limit is recorded (so the contributor sees why); later ones are not,
                # so a flood of submissions cannot grow the ledger
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
                reason = already_accepted_reason(sub.round)
                return Verdict(False, reason)
            return Verdict(accepted, reason, int(row.id or 0))

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
        key, status, _ = self._contributor(sub.contributor_id)
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

    def receive(
        self, sub: SignedSubmission, payload: Path, content: RecordDict, *, node_id: int
    ) -> tuple[Verdict, RecordDict]:
        """Check `sub` (as `check` does) and record the decision.

        What takes time (the contributor's row, the signature, reading and hashing the bytes,
        one pass over the envelope's values) runs outside `lock`, so submissions are checked
        side by side; under it the round is looked at again (it may have closed or moved on
        meanwhile), one contributor's second acceptance is refused, and the decision is
        recorded.
        """
        checked = self.open_round
        reason = self._sender_reason(sub, node_id) or self._round_reason(sub, checked)
        envelope = ""
        if not reason:
            assert checked is not None
            data = payload.read_bytes()
            if len(data) != sub.payload_size or sha256_bytes(data) != sub.payload_sha256:
                reason = "payload size or SHA-256 differs from the signed statement"
            else:
                envelope = envelope_reason(data, checked)
        with self.lock:
            current = self.open_round
            if not reason:
                reason = self._round_reason(sub, current)
            if not reason and current is not checked:  # a new round opened: check against it
                assert current is not None
                envelope = envelope_reason(payload.read_bytes(), current)
            if not reason and current is not None and sub.contributor_id in current.accepted:
                reason = already_accepted_reason(sub.round)
            reason = reason or envelope
            if reason:
                verdict = self.refuse(sub, reason)
            else:
                stored = self.payload_dir / f"{sub.payload_sha256}.zgde"
                shutil.copyfile(payload, stored)
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
        metrics = content.metric_records.get(TRAIN_METRICS, MetricRecord())
        result = ConfigRecord(IntakeResult.of(sub, verdict).to_record())
        return verdict, RecordDict({SUBMISSION: result, TRAIN_METRICS: metrics})

    def payload_path(self, sha256: str) -> Path:
        return self.payload_dir / f"{sha256}.zgde"

    def outcome(self, contributor_id: str, round_number: int) -> Outcome:
        with Session(self.engine) as session:
            rnd = ledger.get_round(session, number=round_number)
            subs = ledger.list_submissions(
                session, round_number=round_number, contributor_id=contributor_id
            )
            if rnd is None or not subs:
                return Outcome(
                    "none",
                    "no submission from you for this round",
                    round_status=rnd.status if rnd else "",
                )
            sub = sorted(subs, key=lambda s: (s.decision == "accepted", s.id or 0))[-1]
            reason = sub.aggregation_reason or sub.reason
            return Outcome(
                sub.decision,
                reason,
                float(sub.quality or 0.0),
                float(sub.reward or 0.0),
                rnd.status,
                rnd.new_version or "",
            )


def envelope_reason(data: bytes, current: OpenRound) -> str:
    """Empty string when envelope `data` fits the open round, else why it does not.

    In order of cost: a valid header, exactly the round's tensors, the round's codec, then
    one pass over the values (a tensor at a time) for NaN / Inf and the L2 norm bound.
    """
    try:
        header = inspect_envelope(data, max_elements=sum(s.numel for s in current.layout))
    except EnvelopeError as exc:
        return f"update envelope is invalid: {exc}"
    if tuple((s.name, s.shape) for s in header.layout) != tuple(
        (s.name, s.shape) for s in current.layout
    ):
        return "update tensors (names or shapes) differ from what this round trains; use the task's LoRA settings"
    if current.codec and header.codec != current.codec:
        return (
            f"update is encoded with {header.codec} but round {current.number} asks for "
            f"{current.codec}; compress it with the task's codec"
        )
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


def _not_published(version: str) -> RequestError:
    return RequestError("NOT_FOUND", f"model version {version[:64]!r} is not published here")


def stated_mechanism(content: RecordDict) -> ledger.DpMechanism | None:
    """The DP-SGD mechanism a submission states in its metrics (`dp_noise_multiplier`,
    `dp_sample_rate`, `dp_steps`, `dp_delta`, `dp_accountant_prv`), or None when it ran none or
    the values cannot describe one (a sigma that is not positive, a rate outside (0, 1], ...)."""
    metrics = content.metric_records.get(TRAIN_METRICS)
    if metrics is None:
        return None
    values = [
        metrics.get(k) for k in ("dp_noise_multiplier", "dp_sample_rate", "dp_steps", "dp_delta")
    ]
    if not all(isinstance(v, int | float) and math.isfinite(v) for v in values):
        return None
    sigma, q, steps, delta = (float(v) for v in values)  # type: ignore[arg-type]
    if not (
        sigma > 0 and 0 < q <= 1 and steps.is_integer() and 1 <= steps <= 1e9 and 0 < delta < 1
    ):
        return None
    accountant = "prv" if metrics.get("dp_accountant_prv") == 1 else "rdp"
    return ledger.DpMechanism(sigma, q, int(steps), delta, accountant)


def claimed_epsilon(content: RecordDict) -> float | None:
    """The round's sample-level epsilon a submission reports (its `epsilon` metric), if finite and >= 0.

    The contributor computes it (`zoo_gym.client.privacy`); the coordinator records it, it cannot check it.
    """
    metrics = content.metric_records.get(TRAIN_METRICS)
    value = metrics.get("epsilon") if metrics is not None else None
    if isinstance(value, int | float) and math.isfinite(value) and value >= 0:
        return float(value)
    return None
