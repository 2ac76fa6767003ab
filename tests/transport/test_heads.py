"""`head_deadline` under uvicorn in this process, on 127.0.0.1, talked to over raw sockets.

The deadline here is half a second so each test takes about a second; what it bounds (the time
to a whole head, from opening or from the last answer) does not depend on its length.
"""

from __future__ import annotations

import asyncio
import select
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn
from starlette.types import Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from zoo_gym.transport.heads import head_deadline

DEADLINE_S = 0.5
SLOW_ANSWER_S = 3 * DEADLINE_S
REQUEST = b"GET / HTTP/1.1\r\nHost: test\r\n\r\n"


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    """Answers "ok", or "late" after SLOW_ANSWER_S on /slow."""
    if scope["type"] != "http":
        return
    if scope["path"] == "/slow":
        await asyncio.sleep(SLOW_ANSWER_S)
    body = b"late" if scope["path"] == "/slow" else b"ok"
    headers = [(b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def serve(http: type[H11Protocol] | str) -> Iterator[tuple[str, int]]:
    listening = socket.create_server(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, http=http, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listening]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield listening.getsockname()
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        listening.close()


@pytest.fixture(scope="module")
def deadline() -> Iterator[tuple[str, int]]:
    yield from serve(head_deadline(DEADLINE_S))


@pytest.fixture(scope="module")
def plain() -> Iterator[tuple[str, int]]:
    yield from serve("h11")


def closed(sock: socket.socket) -> bool:
    """Whether the server closed `sock` (it never answers these tests' partial heads)."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0)) and sock.recv(1) == b""


def trickle(address: tuple[str, int], give_up_s: float) -> float:
    """Send a request line one byte every 0.1 s; seconds until the server closed the connection
    (`give_up_s` if it had not by then)."""
    start = time.monotonic()
    with socket.create_connection(address) as sock:
        for byte in b"GET /" + b"x" * 1000:
            if closed(sock) or time.monotonic() - start > give_up_s:
                break
            sock.sendall(bytes([byte]))
            time.sleep(0.1)
        return time.monotonic() - start


def ask(sock: socket.socket, request: bytes = REQUEST) -> bytes:
    """Send `request` and read its answer's body (the app's answers are short)."""
    sock.sendall(request)
    answer = b""
    while not answer.endswith((b"ok", b"late")):
        answer += sock.recv(4096)
    return answer.partition(b"\r\n\r\n")[2]


def test_a_trickled_head_is_closed_at_the_deadline(deadline: tuple[str, int]) -> None:
    took = trickle(deadline, give_up_s=10 * DEADLINE_S)

    assert DEADLINE_S * 0.9 < took < DEADLINE_S + 2


def test_uvicorn_alone_waits_for_a_trickled_head(plain: tuple[str, int]) -> None:
    took = trickle(plain, give_up_s=4 * DEADLINE_S)

    assert took > 4 * DEADLINE_S  # still open: what the deadline is for


def test_an_answer_slower_than_the_deadline_is_not_cut_off(deadline: tuple[str, int]) -> None:
    with socket.create_connection(deadline, timeout=10) as sock:
        start = time.monotonic()
        body = ask(sock, b"GET /slow HTTP/1.1\r\nHost: test\r\n\r\n")
        took = time.monotonic() - start

    assert body == b"late"
    assert took >= SLOW_ANSWER_S


def test_the_deadline_runs_from_the_last_answer(deadline: tuple[str, int]) -> None:
    with socket.create_connection(deadline, timeout=10) as sock:
        opened = time.monotonic()
        answers = [ask(sock)]
        for _ in range(2):  # 0.6 of the deadline apart: past it from opening, not from an answer
            time.sleep(0.6 * DEADLINE_S)
            answers.append(ask(sock))
        answered = time.monotonic()
        while not closed(sock) and time.monotonic() - answered < 10 * DEADLINE_S:
            time.sleep(0.02)
        idle = time.monotonic() - answered

    assert answers == [b"ok"] * 3
    assert answered - opened > DEADLINE_S
    assert DEADLINE_S * 0.9 < idle < DEADLINE_S + 2
