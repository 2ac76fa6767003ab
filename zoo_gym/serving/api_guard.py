"""What guards `gym-serve`'s API: API keys, failed-key pacing, body limits, OpenAI-shaped errors.

Keys. A caller presents ``Authorization: Bearer KEY``. The server holds only SHA-256 digests
of the keys it accepts (a key file lists them, one hex digest a line; a key given on the
command line or in the environment is hashed on start) and compares the presented key's
digest with each in constant time. With no key configured every request is served, which the
server allows on a loopback address only (`server`).

Failed keys. Each failure takes one unit from its address's budget (`max_failures`, refilled
evenly over `lockout_s`); a failure that finds the budget empty is answered 429 with
`Retry-After` instead of 401. A right key is always served, whatever its address did before.

Bodies. A `Content-Length` over `max_body_bytes` is answered 413 before a byte of the body is
read; a chunked body is counted as it arrives and cut off at the limit; a body that has not
arrived within `read_timeout_s` is answered 408. The connection is closed after either.

Errors. Every error is OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``,
one line that says what was wrong and what to do, and never repeats the input.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import re
from collections.abc import Iterable
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from zoo_gym.transport.bodies import BodyTooLarge, read_body, replay
from zoo_gym.transport.limits import TokenBuckets

DIGEST = re.compile(r"[0-9a-f]{64}")
MAX_MESSAGE_CHARS = 300
MAX_ADDRESSES = 100_000


class ApiError(Exception):
    """An answer in OpenAI's error shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.code, self.param, self.headers = code, param, headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, code=self.code, param=self.param)


def error_body(
    message: str, *, type: str, code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    text = (
        message if len(message) <= MAX_MESSAGE_CHARS else message[: MAX_MESSAGE_CHARS - 3] + "..."
    )
    return {"error": {"message": text, "type": type, "param": param, "code": code}}


def key_digest(key: str) -> str:
    """Hex SHA-256 of an API key, the only form of it a key file holds."""
    return hashlib.sha256(key.encode()).hexdigest()


def read_key_file(text: str, source: str) -> list[str]:
    """The digests in a key file: one hex SHA-256 a line; `#` starts a comment."""
    digests = []
    for number, line in enumerate(text.splitlines(), 1):
        entry = line.split("#", 1)[0].strip().lower()
        if not entry:
            continue
        if not DIGEST.fullmatch(entry):
            raise ValueError(
                f"{source}:{number}: not a SHA-256 hex digest; write each key's digest "
                "(`printf %s KEY | sha256sum`), never the key"
            )
        digests.append(entry)
    return digests


class KeyCheck:
    """The key digests the server accepts, and the failure budget of each address."""

    def __init__(
        self, digests: Iterable[str], *, max_failures: int = 10, lockout_s: float = 300.0
    ) -> None:
        self.digests = tuple(digests)
        self.failures = TokenBuckets(max_failures / lockout_s, max_failures, max_keys=MAX_ADDRESSES)

    @property
    def required(self) -> bool:
        return bool(self.digests)

    def accepts(self, key: str) -> bool:
        presented = key_digest(key)
        found = False
        for digest in self.digests:  # every digest is compared: the time says nothing
            found |= hmac.compare_digest(presented, digest)
        return found

    def check(self, authorization: str | None, address: str) -> None:
        """Return when the header holds an accepted key (or none is required); else ApiError
        401, or 429 once the address's failure budget is spent."""
        if not self.required:
            return
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() == "bearer" and key.strip() and self.accepts(key.strip()):
            return
        wait = self.failures.take(address)
        if wait > 0:
            raise ApiError(
                429,
                f"too many failed API keys from this address; retry in {math.ceil(wait)} s "
                "with a valid key",
                type="rate_limit_error",
                code="too_many_failed_keys",
                headers={"Retry-After": str(max(1, math.ceil(wait)))},
            )
        missing = not authorization
        raise ApiError(
            401,
            "no API key given; send `Authorization: Bearer KEY`"
            if missing
            else "the API key is not valid; check the key the server's operator gave you",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )


# --- before parsing -----------------------------------------------------------------------------


class BodyLimits:
    """Pure ASGI middleware: the body whole within `max_body_bytes` and `read_timeout_s`,
    before the app sees it (413 / 408 and the connection closed otherwise)."""

    def __init__(self, app: ASGIApp, *, max_body_bytes: int, read_timeout_s: float) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.read_timeout_s = read_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            body = await read_body(scope, receive, self.max_body_bytes, self.read_timeout_s)
        except BodyTooLarge:
            too_large = (
                f"the request body is larger than {self.max_body_bytes} bytes, the most this "
                "server accepts; send a shorter prompt"
            )
            await send_error(send, ApiError(413, too_large, code="request_too_large"), close=True)
            return
        except TimeoutError:
            late = (
                f"the request body did not arrive within {self.read_timeout_s:g} s; send it at once"
            )
            await send_error(send, ApiError(408, late, code="request_timeout"), close=True)
            return
        if body is None:  # the client went away
            return
        await self.app(scope, replay(body, receive), send)


async def send_error(send: Send, error: ApiError, *, close: bool = False) -> None:
    body = json.dumps(error.body()).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *((k.lower().encode(), v.encode()) for k, v in error.headers.items()),
    ]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
