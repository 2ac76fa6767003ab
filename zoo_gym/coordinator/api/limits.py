"""Limits of the REST API: what one request may carry, and how failed credentials are answered.

What a request may carry is bounded before anything parses it:

- The HTTP server reads the request line and headers into at most `api_max_header_bytes`
  (h11's limit on an incomplete event); a longer head is answered 400 and the connection closed,
  so neither a long URL nor a long header reaches the app. A connection that has not sent a
  whole head within `api_read_timeout_s` of opening (or of its last answer) is closed
  (`transport.heads.guarded_h11`, which `gym-serve` runs too), so a client trickling bytes
  cannot hold a connection for ever; and no address holds more than
  `api_max_connections_per_address` connections at once (the next is answered 503 and closed
  before it is read).
- `RequestLimits`, pure ASGI middleware around the app, answers a path that holds a control
  character (NUL, ...) with 404 before routing, and bounds the body to `api_max_body_bytes`: a
  larger `Content-Length` is answered 413 before a byte of the body is read, and a body without
  one (chunked) is counted as it arrives and cut off with 413 at the limit. After a 413 the
  connection is closed, so the rest of the body is never read. The body is read whole (it is
  small) before the app runs, within `api_read_timeout_s` (else 408); nothing downstream sees
  more than the limit.
- Error bodies never repeat the input (`app`): validation errors name the field and the rule
  only, and every detail is cut to `MAX_DETAIL_CHARS`.

Failed credentials (`ApiGuard`). Every secret the API accepts is out of reach of guessing (API
keys carry 256 random bits, contributor tokens an HMAC-SHA256 under a key drawn at start, sign-in
answers an Ed25519 signature), so what failures can cost is work and noise, and what a lockout
must never do is shut out the people who hold a right credential. Hence:

- A presented credential is always verified, and one that verifies is served: no flood from its
  address, and no failures naming it, ever refuse it. An admin behind the same proxy as an
  attacker still gets in.
- Each failure takes one unit from two budgets: its address's and that of the credential it
  names (an API key's prefix, a contributor's id; a token naming nothing counts for its address
  only). A budget holds `api_max_failures` and refills evenly over `api_lockout_s`. A failure
  that finds either budget empty is answered 429 with `Retry-After` (the time until the budget
  holds one again) instead of 401, so an address guessing at any rate is told to stop, and so is
  a botnet spread over many addresses that aims at one key.
- Why not lock the address out, as a password form would: behind a proxy or load balancer every
  operator shares one address, and one attacker would lock them all out. Why not lock the
  credential: a key's prefix is in the audit log, and anyone could lock its owner out.
- Sign-in (`/auth/challenge`, `/auth/token`) also takes a token from the caller's address's
  bucket (`api_auth_rate_per_s`, burst `api_auth_burst`); an empty bucket is answered 429.

Addresses are the socket peer (`request.client.host`). Every table is bounded (least recently
used out), so a flood of new addresses or names cannot grow memory without bound.
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
from collections.abc import Callable

from fastapi import HTTPException, Request, status
from starlette.types import ASGIApp, Receive, Scope, Send

from zoo_gym.ledger.apikeys import token_prefix
from zoo_gym.transport.bodies import BodyTooLarge, read_body, replay
from zoo_gym.transport.limits import RefusalPacer, TokenBuckets

log = logging.getLogger(__name__)

WARN_EVERY_S = 60
MAX_ADDRESSES = 100_000
MAX_CREDENTIALS = 10_000
MAX_DETAIL_CHARS = 300
CONTROL_CHARACTER = re.compile(r"[\x00-\x1f\x7f]")
_CONTRIBUTOR_ID = re.compile(r"^[0-9a-f]{32}$")


class ApiGuard:
    """Sign-in rate per address; failed-credential budgets per address and per credential, and
    the pacing of refusals past them (`pacing`). Thread-safe (each table is a `TokenBuckets`),
    but `pacer` is for the server's event loop only."""

    def __init__(
        self,
        *,
        auth_rate_per_s: float = 2.0,
        auth_burst: int = 20,
        max_failures: int = 10,
        lockout_s: float = 300.0,
        refusal_delay_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_failures = max_failures
        self.lockout_s = lockout_s
        self.pacer = RefusalPacer(refusal_delay_s)  # used by the middleware, on the event loop
        self.clock = clock
        self._warned_at = -math.inf
        refill = max_failures / lockout_s
        self.sign_in = TokenBuckets(
            auth_rate_per_s, auth_burst, max_keys=MAX_ADDRESSES, clock=clock
        )
        self.address_failures = TokenBuckets(
            refill, max_failures, max_keys=MAX_ADDRESSES, clock=clock
        )
        self.credential_failures = TokenBuckets(
            refill, max_failures, max_keys=MAX_CREDENTIALS, clock=clock
        )

    def spent(self, address: str, credential: str | None) -> bool:
        """Whether the address's or the credential's failure budget is empty now."""
        if self.address_failures.wait(address) > 0:
            return True
        return credential is not None and self.credential_failures.wait(credential) > 0

    def failed(self, address: str, credential: str | None) -> float:
        """Count one failed credential; seconds until the address's and the credential's
        budgets allow another (0.0: both had room, answer 401)."""
        wait = self.address_failures.take(address)
        if credential is not None:
            wait = max(wait, self.credential_failures.take(credential))
        if wait > 0 and self.clock() - self._warned_at > WARN_EVERY_S:
            self._warned_at = self.clock()  # a race here costs one extra line, no more
            log.warning(
                "REST: failed credentials past their budget (from %s, naming %s); "
                "answering 429 (at most one such line per %d s)",
                address,
                credential or "nothing",
                WARN_EVERY_S,
            )
        return wait


def credential_name(token: str) -> str | None:
    """What a presented bearer token names: an API key's prefix or a contributor's id (None:
    nothing; such a token counts for its address only)."""
    prefix = token_prefix(token)
    if prefix is not None:
        return f"apikey:{prefix}"
    parts = token.split("_")
    if len(parts) == 4 and parts[0] == "zgc" and _CONTRIBUTOR_ID.match(parts[1]):
        return f"contributor:{parts[1]}"
    return None


def client_address(request: Request) -> str:
    return scope_address(request.scope)


def too_many(detail: str, retry_after_s: float) -> HTTPException:
    return HTTPException(
        status.HTTP_429_TOO_MANY_REQUESTS,
        detail=detail,
        headers={"Retry-After": str(max(1, math.ceil(retry_after_s)))},
    )


def refuse_credential(
    guard: ApiGuard, address: str, credential: str | None, unauthorized: HTTPException
) -> HTTPException:
    """The answer to a credential that did not verify: `unauthorized` (401) within the failure
    budgets, else 429 with `Retry-After`."""
    wait = guard.failed(address, credential)
    if wait <= 0:
        return unauthorized
    return too_many(
        f"too many failed credentials from this address or for this credential; "
        f"retry in {math.ceil(wait)} s with a valid one (a valid credential is always served)",
        wait,
    )


def take_sign_in(guard: ApiGuard, address: str) -> None:
    wait = guard.sign_in.take(address)
    if wait > 0:
        raise too_many(f"too many sign-in requests from {address}; retry in {wait:.1f} s", wait)


def short(text: str, limit: int = MAX_DETAIL_CHARS) -> str:
    """`text` cut to `limit` characters (an error detail must stay small)."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --- before parsing -----------------------------------------------------------------------------


class RequestLimits:
    """Pure ASGI middleware: refuse a path with control characters (404), a body over
    `max_body_bytes` (413) and one not sent within `read_timeout_s` (408) before the app parses
    anything; the connection is closed after a 413 or 408."""

    def __init__(self, app: ASGIApp, *, max_body_bytes: int, read_timeout_s: float) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.read_timeout_s = read_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if CONTROL_CHARACTER.search(scope["path"]):
            await answer(send, 404, "no such path: a path never holds control characters (NUL)")
            return
        try:
            first = await read_body(scope, receive, self.max_body_bytes, self.read_timeout_s)
        except BodyTooLarge:
            await refuse_body(scope, send, 413, self.too_large())
            return
        except TimeoutError:
            late = (
                f"the request body did not arrive within {self.read_timeout_s:g} s; send it at once"
            )
            await refuse_body(scope, send, 408, late)
            return
        if first is None:  # the client went away
            return
        await self.app(scope, replay(first, receive), send)

    def too_large(self) -> str:
        return (
            f"the request body is larger than {self.max_body_bytes} bytes, "
            "the most this API accepts; send a smaller one"
        )


async def refuse_body(scope: Scope, send: Send, status_code: int, detail: str) -> None:
    """Answer a body refused by size or time and close the connection. It counts as a failure
    of its address; past the address's budget the answer waits the refusal delay."""
    guard: ApiGuard = scope["app"].state.zoo.guard
    if guard.failed(scope_address(scope), None) > 0:
        await guard.pacer.pause()
    await answer(send, status_code, detail, close=True)


def scope_address(scope: Scope) -> str:
    """The socket peer of an ASGI request ("unknown" when the server did not say)."""
    client = scope.get("client")
    return str(client[0]) if client else "unknown"


async def answer(
    send: Send,
    status_code: int,
    detail: str,
    *,
    close: bool = False,
    headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    """A JSON error `{"detail": ...}` straight from the middleware, with `headers` added."""
    body = json.dumps({"detail": detail}).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *(headers or ()),
    ]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status_code, "headers": headers})
    await send({"type": "http.response.body", "body": body})
