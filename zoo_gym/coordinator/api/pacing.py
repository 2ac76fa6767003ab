"""Failed credentials past their budget are answered slowly, and without the app.

`ApiGuard` answers 429 once an address's or a credential's failure budget is spent, but a caller
who ignores `Retry-After` and asks again at once would still cost a whole request each time
(routing, dependencies, a database query for the key), and a few such loops keep the
coordinator's interpreter busy while rounds run beside it. `FailurePacing`, pure ASGI middleware
in front of the app, takes over for a request whose address or named credential has an empty
failure budget:

- a credential that verifies goes on to the app at once: an API key found in `KeyTable` (with its
  digest), or a contributor token whose MAC holds; the app then checks it as always;
- anything else (no token, a bad one, a key prefix the table does not know) is answered after
  the guard's refusal delay (`api_refusal_delay_s`), without the app: 429 with `Retry-After`
  while a budget is empty, as `ApiGuard` would. The wait costs a sleeping task, no thread (at
  most `MAX_PACED` wait at once, the rest are answered at once), and a caller that waits for its
  answer before asking again (as HTTP/1.1 clients do on one connection) makes at most one
  request per delay per connection, so a flood paces itself;
- for a key prefix the table does not hold, the table is read from the ledger again, at most
  once per delay and once for all the requests waiting on it, so a key issued by
  `gym-coordinator apikey create` a moment ago is served, after at most one delay, even from a
  flooded address, and a flood of made-up prefixes costs one read of the (small) key table
  per delay.

Bodies refused by size or time (`limits.RequestLimits`) count as failures of their address and
are paced the same way past its budget.

Routes that need no token (`/health`, sign-in with its own rate) are not paced.
"""

from __future__ import annotations

import asyncio
import hmac
import math
import time
from collections.abc import Callable
from typing import Protocol

from starlette.types import ASGIApp, Receive, Scope, Send

from zoo_gym.coordinator.api.auth import ContributorAuth
from zoo_gym.coordinator.api.limits import ApiGuard, answer, credential_name, scope_address
from zoo_gym.ledger.apikeys import hash_token, token_prefix


class Guarded(Protocol):
    """What the middleware reads of the app's state (`deps.ApiState`): the guard and the
    contributor tokens the routes use."""

    guard: ApiGuard
    auth: ContributorAuth


class KeyTable:
    """The active API keys' prefixes and digests, read through `load` when a request needs a
    fresher copy than the one held; concurrent readers share one read."""

    def __init__(
        self, load: Callable[[], dict[str, str]], *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._load = load
        self.clock = clock
        self._digests: dict[str, str] = {}
        self._read_at = -math.inf
        self._reading: asyncio.Lock | None = None

    def verifies(self, token: str) -> bool | None:
        """True: a held key's token; False: not an API key, or a wrong secret for a held prefix;
        None: a prefix not held (a fresher copy may hold it)."""
        prefix = token_prefix(token)
        if prefix is None:
            return False
        digest = self._digests.get(prefix)
        if digest is None:
            return None
        return hmac.compare_digest(digest, hash_token(token))

    async def fresh_since(self, moment: float, *, spacing_s: float) -> None:
        """Hold a copy read no earlier than `moment`, reading at most once per `spacing_s`
        (the ledger is read in a worker thread; concurrent callers share one read)."""
        if self._reading is None:
            self._reading = asyncio.Lock()
        async with self._reading:
            if self._read_at >= moment:
                return
            await asyncio.sleep(max(0.0, self._read_at + spacing_s - self.clock()))
            started = self.clock()
            self._digests = await asyncio.to_thread(self._load)
            self._read_at = started


class FailurePacing:
    """Pure ASGI middleware: see the module docstring."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        keys: KeyTable,
        open_routes: frozenset[tuple[str, str]],
    ) -> None:
        self.app = app
        self.keys = keys
        self.open_routes = open_routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or (scope["method"], scope["path"]) in self.open_routes:
            await self.app(scope, receive, send)
            return
        state: Guarded = scope["app"].state.zoo
        guard, address = state.guard, scope_address(scope)
        token = bearer_token(scope)
        named = credential_name(token) if token is not None else None
        if guard.pacer.delay_s <= 0 or not guard.spent(address, named):
            await self.app(scope, receive, send)
            return
        asked_at = self.keys.clock()
        verdict = self.verdict(token, state.auth)
        if verdict is None and token is not None:  # a key prefix not held: read the keys again
            await self.keys.fresh_since(asked_at, spacing_s=guard.pacer.delay_s)
            verdict = self.keys.verifies(token)
        if verdict:
            await self.app(scope, receive, send)
            return
        await guard.pacer.pause()
        await refuse(send, guard, address, named)

    def verdict(self, token: str | None, auth: ContributorAuth) -> bool | None:
        """Whether `token` verifies from memory; None: an API key prefix not held yet."""
        if token is None:
            return False
        if token_prefix(token) is not None:
            return self.keys.verifies(token)
        return auth.verify_token(token) is not None


async def refuse(send: Send, guard: ApiGuard, address: str, named: str | None) -> None:
    """Count the failure and answer it: 429 while a budget is spent, else the app's 401."""
    wait = guard.failed(address, named)
    if wait <= 0:  # a budget refilled during the delay: the app's own 401
        await answer(
            send,
            401,
            "the credential is missing, unknown, revoked or expired",
            headers=[(b"www-authenticate", b"Bearer")],
        )
        return
    retry = max(1, math.ceil(wait))
    await answer(
        send,
        429,
        f"too many failed credentials from this address or for this credential; retry in "
        f"{retry} s with a valid one (a valid credential is always served)",
        headers=[(b"retry-after", str(retry).encode())],
    )


def bearer_token(scope: Scope) -> str | None:
    """The token of an `Authorization: Bearer` header (None: no such header)."""
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" and token.strip() else None
    return None
