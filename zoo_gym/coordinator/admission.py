"""Registration: who may register a new key, and how fast new keys are taken.

A registration flood meets the allowances for new keys first: they are checked from memory,
before the signature or the database, and nothing is written for a refused key.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace

from zoo_gym import ledger
from zoo_gym.coordinator.authentication import check_clock
from zoo_gym.core.identity import contributor_id, verify
from zoo_gym.core.protocol import RequestError, register_statement
from zoo_gym.ledger import Engine, Session
from zoo_gym.transport.limits import TokenBuckets

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


class KeyAdmission:
    """The admission policy applied: its allowances for new keys, and the registered ids."""

    def __init__(self, engine: Engine, policy: AdmissionPolicy) -> None:
        self.engine = engine
        self.policy = policy
        self._known: set[str] | None = None
        self._known_lock = threading.Lock()

    @property
    def policy(self) -> AdmissionPolicy:
        return self._policy

    @policy.setter
    def policy(self, policy: AdmissionPolicy) -> None:
        """A new policy starts with full allowances."""
        self._policy = policy
        self._new_keys = TokenBuckets(policy.rate_per_s, policy.burst, max_keys=1)
        self._new_keys_by_address = TokenBuckets(
            policy.per_address_rate_per_s, policy.per_address_burst
        )
        self._impatience = TokenBuckets(IMPATIENCE_RATE_PER_S, IMPATIENCE_BURST)

    @property
    def require_approval(self) -> bool:
        """Whether new keys wait for an operator (admission "approval")."""
        return self._policy.admission == "approval"

    @require_approval.setter
    def require_approval(self, value: bool) -> None:
        if value != self.require_approval:
            self._policy = replace(self._policy, admission="approval" if value else "open")

    def register(
        self,
        *,
        public_key: bytes,
        name: str,
        timestamp_ms: int,
        signature: bytes,
        invite: str,
        peer: str | None,
        clock_skew_s: float,
    ) -> str:
        """Register a key under the policy; its status (a known key's as it stands).

        Checks run cheapest first and nothing is written for a refused key: a new key while
        the allowances for new keys are spent (refused from memory, before the signature or
        the database), the signature, a known key (answered without spending any allowance),
        an invitation code's presence, the per-address and global allowances (spent only by
        callers over the network, `peer` not None), then the code itself.
        """
        if len(public_key) != 32:
            raise RequestError("INVALID_ARGUMENT", "public key must be a raw 32-byte Ed25519 key")
        check_clock(timestamp_ms, clock_skew_s=clock_skew_s)
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
                return known.status
            return self._admit(session, cid, public_key, name[:64], invite, peer)

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
        policy = self._policy
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
        keep = self._policy.reserve if self._impatience.wait(peer) > 0 else 0
        wait = overall.take("", keep=keep) if spend else overall.wait("", keep=keep)
        if wait > 0:
            self._impatience.take(peer)
            raise RequestError(
                "RESOURCE_EXHAUSTED",
                f"too many new keys registered just now (the coordinator takes "
                f"{self._policy.rate_per_s:g} per second); retry in {max(1.0, wait):.0f} s",
            )
