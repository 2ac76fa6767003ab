"""A request body read whole within a size and a time limit, before an HTTP app parses it.

What both HTTP servers (the coordinator's REST API and `gym-serve`) do in their ASGI middleware:
refuse a body whose declared `Content-Length` is over the limit before reading it, read the
rest chunk by chunk and stop once it passes the limit, give up when it does not arrive in time,
and hand the app the body as one message. Each server answers the refusals in its own shape.
The head before the body has its own deadline, in the HTTP protocol itself (`heads`).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from starlette.types import Message, Receive, Scope


class BodyTooLarge(Exception):
    """The body is declared, or grew while it was read, past the limit."""


def content_length(scope: Scope) -> int | None:
    """The declared `Content-Length` (None: not declared; the HTTP parser refused bad ones)."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            text = value.decode("latin-1").strip()
            return int(text) if text.isdigit() else None
    return None


async def read_body(scope: Scope, receive: Receive, limit: int, timeout_s: float) -> Message | None:
    """The whole body as one `http.request` message, or None when the client went away first.

    Raises BodyTooLarge when the declared length or the bytes read pass `limit`, and
    TimeoutError when the body has not arrived within `timeout_s`."""
    declared = content_length(scope)
    if declared is not None and declared > limit:
        raise BodyTooLarge
    chunks: list[bytes] = []
    size = 0
    async with asyncio.timeout(timeout_s):
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return None
            chunk: bytes = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise BodyTooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}


def replay(first: Message, receive: Receive) -> Receive:
    """`receive` that hands out `first` once, then what the server sends (a disconnect)."""
    pending = [first]

    async def replayed() -> Message:
        if pending:
            return pending.pop()
        return await receive()

    return replayed
