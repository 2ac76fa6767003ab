"""Contributor sign-in for the REST API: a signed nonce challenge, then a short-lived token.

1. ``POST /auth/challenge {contributor_id}`` returns a random nonce and its expiry.
2. The contributor signs `challenge_statement(contributor_id, nonce, expires_at_ms)`
   (`zoo_gym.core.protocol.rest_challenge_statement`) with its Ed25519 key (it builds the bytes
   itself, so it never signs bytes the server chose freely).
3. ``POST /auth/token {contributor_id, nonce, signature}`` checks the signature against the key
   the ledger registered for that contributor and returns a bearer token scoped to it.

A challenge is single use and expires after `CHALLENGE_TTL_S`. A token is
``zgc_<contributor_id>_<expires_at_ms>_<HMAC-SHA256>`` under a key drawn when the API starts:
nothing is stored per token, and a restart invalidates every token.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from zoo_gym.core.protocol import REST_AUTH_PREFIX, rest_challenge_statement

STATEMENT_PREFIX = REST_AUTH_PREFIX
TOKEN_SCHEME = "zgc"
CHALLENGE_TTL_S = 120.0
TOKEN_TTL_S = 900.0
MAX_PENDING = 10_000


challenge_statement = rest_challenge_statement
"""Bytes a contributor signs to answer a REST challenge (defined in `zoo_gym.core.protocol`,
which client and coordinator share)."""


@dataclass(frozen=True)
class Challenge:
    contributor_id: str
    nonce: str
    expires_at_ms: int

    @property
    def statement(self) -> bytes:
        return challenge_statement(self.contributor_id, self.nonce, self.expires_at_ms)


class TooManyChallenges(Exception):
    """More unanswered challenges than `MAX_PENDING` are outstanding."""


class ContributorAuth:
    """Pending challenges and the token key of one API instance. Thread-safe."""

    def __init__(
        self,
        *,
        challenge_ttl_s: float = CHALLENGE_TTL_S,
        token_ttl_s: float = TOKEN_TTL_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.challenge_ttl_s = challenge_ttl_s
        self.token_ttl_s = token_ttl_s
        self.clock = clock
        self._key = secrets.token_bytes(32)
        self._pending: dict[str, Challenge] = {}
        self._lock = threading.Lock()

    def _now_ms(self) -> int:
        return int(self.clock() * 1000)

    def challenge(self, contributor_id: str) -> Challenge:
        """A fresh challenge for `contributor_id`."""
        now = self._now_ms()
        with self._lock:
            self._pending = {n: c for n, c in self._pending.items() if c.expires_at_ms > now}
            if len(self._pending) >= MAX_PENDING:
                raise TooManyChallenges(f"{len(self._pending)} challenges are pending")
            issued = Challenge(
                contributor_id, secrets.token_hex(16), now + int(self.challenge_ttl_s * 1000)
            )
            self._pending[issued.nonce] = issued
        return issued

    def redeem(self, contributor_id: str, nonce: str) -> Challenge | None:
        """Spend the challenge `nonce`; None when unknown, spent, expired or for someone else."""
        with self._lock:
            issued = self._pending.pop(nonce, None)
        if issued is None or issued.contributor_id != contributor_id:
            return None
        return issued if issued.expires_at_ms > self._now_ms() else None

    def _mac(self, contributor_id: str, expires_at_ms: int) -> str:
        message = f"{contributor_id}|{expires_at_ms}".encode()
        return hmac.new(self._key, message, hashlib.sha256).hexdigest()

    def issue_token(self, contributor_id: str) -> tuple[str, int]:
        """A bearer token for `contributor_id` and its expiry (ms since the epoch)."""
        expires = self._now_ms() + int(self.token_ttl_s * 1000)
        return (
            f"{TOKEN_SCHEME}_{contributor_id}_{expires}_{self._mac(contributor_id, expires)}",
            expires,
        )

    def verify_token(self, token: str) -> str | None:
        """The contributor a valid, unexpired token was issued to, else None."""
        parts = token.split("_")
        if len(parts) != 4 or parts[0] != TOKEN_SCHEME or not parts[2].isdigit():
            return None
        contributor_id, expires, mac = parts[1], int(parts[2]), parts[3]
        if not hmac.compare_digest(self._mac(contributor_id, expires), mac):
            return None
        return contributor_id if expires > self._now_ms() else None
