"""`guarded_h11` under uvicorn in this process, on 127.0.0.1, talked to over raw sockets.

The deadline here is half a second so each test takes about a second; what it bounds (the time
to a whole head, from opening or from the last answer) does not depend on its length. The share
per address is 4 (the servers' default is 64) so a test needs few sockets; the counting does not
depend on its size. Clients send from 127.0.0.2 to play a second address (Linux routes all of
127/8 to loopback); the servers listen on 127.0.0.1 only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import select
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn
from starlette.types import Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from zoo_gym.transport.heads import LOG_EVERY_S, AddressShares, GuardedH11, guarded_h11

DEADLINE_S = 0.5
SLOW_ANSWER_S = 3 * DEADLINE_S
REQUEST = b"GET / HTTP/1.1\r\nHost: test\r\n\r\n"
SHARE = 4
SHARE_DEADLINE_S = 30.0  # the share tests keep connections idle between requests
OTHER = "127.0.0.2"
requests_from: list[str] = []  # the client address of every request the app saw


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    """Answers "ok", or "late" after SLOW_ANSWER_S on /slow."""
    if scope["type"] != "http":
        return
    requests_from.append(scope["client"][0])
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
    yield from serve(guarded_h11(DEADLINE_S, 64))


@pytest.fixture
def shared() -> Iterator[tuple[tuple[str, int], type[GuardedH11]]]:
    """A server whose addresses may hold SHARE connections each, and its protocol class."""
    protocol = guarded_h11(SHARE_DEADLINE_S, SHARE)
    requests_from.clear()
    for address in serve(protocol):
        yield address, protocol


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


# --- connections per address ----------------------------------------------------------------------


def connect(address: tuple[str, int], source: str = "127.0.0.1") -> socket.socket:
    return socket.create_connection(address, timeout=10, source_address=(source, 0))


def hold(address: tuple[str, int], count: int, source: str = "127.0.0.1") -> list[socket.socket]:
    """`count` connections from `source`, each answered once (so the server has counted it)."""
    held = [connect(address, source) for _ in range(count)]
    assert [ask(sock) for sock in held] == [b"ok"] * count
    return held


def refused(sock: socket.socket) -> bytes:
    """Send a request on `sock` and read what the server sent until it closed the connection.

    A server that closes a connection without reading what came on it resets it (TCP RST), and
    Linux still hands over what arrived before the reset, so the answer is read whole."""
    with contextlib.suppress(ConnectionResetError, BrokenPipeError):
        sock.sendall(REQUEST)
    answer = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(4096):
            answer += chunk
    return answer


def released(protocol: type[GuardedH11], give_up_s: float = 5.0) -> dict[str, int]:
    """The open connections counted per address once none is left (or after `give_up_s`)."""
    start = time.monotonic()
    while protocol.shares.open and time.monotonic() - start < give_up_s:
        time.sleep(0.01)
    return dict(protocol.shares.open)


def close_all(socks: list[socket.socket]) -> None:
    for sock in socks:
        sock.close()


def test_uvicorn_alone_lets_one_address_hold_any_number(plain: tuple[str, int]) -> None:
    held = hold(plain, 5 * SHARE)

    close_all(held)  # all answered: nothing bounds them but the process's descriptors


def test_a_connection_over_the_share_is_refused_unread(
    shared: tuple[tuple[str, int], type[GuardedH11]],
) -> None:
    address = shared[0]
    held = hold(address, SHARE)
    with connect(address) as extra:
        answer = refused(extra)
    close_all(held)

    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 ") and b"\r\nconnection: close" in head
    assert body == (
        b"too many connections from your address (4 open, the most one address may); "
        b"close some and retry in 5 s\n"
    )
    assert requests_from == ["127.0.0.1"] * SHARE  # the extra request never reached the app


def test_another_address_is_served_while_one_holds_its_share(
    shared: tuple[tuple[str, int], type[GuardedH11]],
) -> None:
    address, protocol = shared
    held = hold(address, SHARE)
    others = hold(address, SHARE, source=OTHER)
    counted = dict(protocol.shares.open)
    close_all(held + others)

    assert counted == {"127.0.0.1": SHARE, OTHER: SHARE}


def test_closing_connections_frees_their_share(
    shared: tuple[tuple[str, int], type[GuardedH11]],
) -> None:
    address, protocol = shared
    held = hold(address, SHARE)
    close_all(held[:2])
    while protocol.shares.open["127.0.0.1"] > SHARE - 2:
        time.sleep(0.01)
    held[:2] = hold(address, 2)  # the two freed slots
    with connect(address) as extra:
        answer = refused(extra)  # and no more
    close_all(held)

    assert answer.startswith(b"HTTP/1.1 503 ")


def test_the_count_returns_to_zero_however_connections_end(
    shared: tuple[tuple[str, int], type[GuardedH11]],
) -> None:
    address, protocol = shared
    held = hold(address, SHARE - 1) + hold(address, SHARE, source=OTHER)
    reset = held.pop()  # dropped with a TCP reset
    reset.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    reset.close()
    asking = connect(address)  # dropped in the middle of its request's answer
    asking.sendall(b"GET /slow HTTP/1.1\r\nHost: test\r\n\r\n")
    with connect(address) as extra:
        refused(extra)
    time.sleep(0.1)  # the app is answering /slow
    asking.close()
    close_all(held)

    ended = released(protocol)
    close_all(hold(address, SHARE))  # a whole share again, however the others ended

    assert ended == {}


def test_a_refused_address_is_logged_once_a_minute(
    shared: tuple[tuple[str, int], type[GuardedH11]], caplog: pytest.LogCaptureFixture
) -> None:
    address = shared[0]
    held = hold(address, SHARE)
    with caplog.at_level(logging.WARNING, logger="zoo_gym.transport.heads"):
        for _ in range(10):
            with connect(address) as extra:
                refused(extra)
    close_all(held)

    assert [r.getMessage() for r in caplog.records if r.name == "zoo_gym.transport.heads"] == [
        "refused 1 connection(s) from 127.0.0.1, which holds 4, the most one address may "
        "(logged at most once a minute per address)"
    ]


def test_refusals_between_two_lines_are_counted_in_the_second(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    shares = AddressShares(1, clock=lambda: now[0])
    assert shares.admit("10.0.0.1") and shares.admit("10.0.0.2")
    with caplog.at_level(logging.WARNING, logger="zoo_gym.transport.heads"):
        for at in (0.0, 1.0, 30.0, LOG_EVERY_S - 1, LOG_EVERY_S, LOG_EVERY_S + 1):
            now[0] = at
            assert not shares.admit("10.0.0.1")
        assert not shares.admit("10.0.0.2")
    shares.release("10.0.0.1")

    assert [r.getMessage().split(",")[0] for r in caplog.records] == [
        "refused 1 connection(s) from 10.0.0.1",  # at 0 s
        "refused 4 connection(s) from 10.0.0.1",  # at 60 s: those at 1, 30, 59 and 60 s
        "refused 1 connection(s) from 10.0.0.2",
    ]
    assert shares.open == {"10.0.0.2": 1} and shares.refused == {"10.0.0.1": 1}
