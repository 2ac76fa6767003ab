"""Attacks on a coordinator's REST API, as a hostile network client would make them.

Each helper opens its own connection(s), so any of them may run in many threads at once (a
mixed-load test does). `source` is the local address to send from: any 127.x.y.z reaches a
server on 127.0.0.1, so one test can play several clients. Nothing here listens.
"""

from __future__ import annotations

import contextlib
import secrets
import select
import socket
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx

CHUNK = 256 << 10


@dataclass(frozen=True)
class Answer:
    """What the server answered: its status (None: it closed without one) and headers."""

    status: int | None
    headers: dict[str, str]
    body: bytes = b""


def _host_port(rest: str) -> tuple[str, int]:
    parts = urlsplit(rest)
    assert parts.hostname is not None and parts.port is not None
    return parts.hostname, parts.port


def client(rest: str, *, source: str = "127.0.0.1", timeout: float = 30.0) -> httpx.Client:
    """An httpx client for `rest` whose connections come from `source`."""
    transport = httpx.HTTPTransport(local_address=source)
    return httpx.Client(base_url=rest, transport=transport, timeout=timeout)


def bad_token_flood(
    rest: str, *, count: int, source: str = "127.0.0.1", path: str = "/rounds", named: str = ""
) -> Counter[int]:
    """`count` calls with bearer tokens that verify for nothing; the statuses answered (0: no
    answer, the connection failed or timed out).

    `named`: an API key prefix to put in every token (aiming at that key), else random ones.
    """
    answered: Counter[int] = Counter()
    with client(rest, source=source) as http:
        for _ in range(count):
            prefix = named or secrets.token_hex(4)
            token = f"zgk_{prefix}_{secrets.token_urlsafe(32)}"
            try:
                response = http.get(path, headers={"Authorization": f"Bearer {token}"})
            except httpx.HTTPError:
                answered[0] += 1
                continue
            answered[response.status_code] += 1
    return answered


def _connect(rest: str, source: str, timeout: float) -> socket.socket:
    sock = socket.create_connection(_host_port(rest), timeout=timeout, source_address=(source, 0))
    sock.settimeout(timeout)
    return sock


NO_ANSWER = Answer(None, {})


def _read_answer(sock: socket.socket) -> Answer:
    """Read one HTTP answer's head (and up to 64 KiB of its body) from `sock`."""
    data = b""
    try:
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    except OSError:
        pass
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    if not lines[0].startswith("HTTP/"):
        return NO_ANSWER
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", "0") or 0)
    try:
        while len(body) < min(length, 65536):
            chunk = sock.recv(65536)
            if not chunk:
                break
            body += chunk
    except OSError:
        pass
    return Answer(int(lines[0].split()[1]), headers, body)


def _answered(sock: socket.socket) -> bool:
    poller = select.poll()  # not select.select: a busy test process has descriptors past 1024
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))


def _exchange(
    rest: str, source: str, timeout: float, send: Callable[[socket.socket], None]
) -> Answer:
    """Connect, `send` (the server may close meanwhile), read the answer; NO_ANSWER when the
    connection could not be made."""
    try:
        sock = _connect(rest, source, timeout)
    except OSError:
        return NO_ANSWER
    with sock:
        with contextlib.suppress(OSError):  # the server closed while we sent: read what it said
            send(sock)
        return _read_answer(sock)


def _sends(raw: bytes) -> Callable[[socket.socket], None]:
    def send(sock: socket.socket) -> None:
        sock.sendall(raw)

    return send


def _stream(sock: socket.socket, piece: bytes, size: int) -> int:
    """Send `piece` until `size` bytes went or the server answered; bytes sent."""
    sent = 0
    while sent < size and not _answered(sock):
        sock.sendall(piece)
        sent += len(piece)
    return sent


def oversized_body(
    rest: str,
    *,
    size: int = 64 << 20,
    chunked: bool = False,
    path: str = "/auth/token",
    method: str = "POST",
    token: str | None = None,
    source: str = "127.0.0.1",
    timeout: float = 30.0,
) -> Answer:
    """Send a `size`-byte JSON-ish body (`method`, POST by default), declared by
    `Content-Length` or sent chunked, until the server answers or closes; what it answered."""
    head = [f"{method} {path} HTTP/1.1", "Host: coordinator", "Content-Type: application/json"]
    head.append("Transfer-Encoding: chunked" if chunked else f"Content-Length: {size}")
    if token is not None:
        head.append(f"Authorization: Bearer {token}")
    piece = b"[" + b"1," * (CHUNK // 2 - 1) + b"1"
    if chunked:
        piece = f"{len(piece):x}\r\n".encode() + piece + b"\r\n"

    def send(sock: socket.socket) -> None:
        sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
        if _stream(sock, piece, size) >= size and chunked:
            sock.sendall(b"0\r\n\r\n")

    return _exchange(rest, source, timeout, send)


def long_head(
    rest: str, *, size: int = 64 << 20, source: str = "127.0.0.1", timeout: float = 30.0
) -> Answer:
    """A GET whose one header is `size` bytes long; what the server answered."""

    def send(sock: socket.socket) -> None:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: coordinator\r\nX-Pad: ")
        _stream(sock, b"a" * CHUNK, size)
        sock.sendall(b"\r\n\r\n")

    return _exchange(rest, source, timeout, send)


MALFORMED_PATHS = (
    "/models/v0000/files/config%00.json",
    "/models/v0000%00/manifest",
    "/contributors/%00",
    "/models/v0000/files/%zz%ff",
    "/models/v0000/files/..%2F..%2Fcoordinator.toml",
    "/models/v0000/files/" + "a" * 4000,
)
"""Malformed paths: NUL bytes, bad percent-encoding, traversal, an overlong segment."""


def malformed_paths(
    rest: str, *, token: str, source: str = "127.0.0.1", paths: tuple[str, ...] = MALFORMED_PATHS
) -> dict[str, int | None]:
    """GET each of `paths` with `token` over raw HTTP (no client normalises them); path -> status."""
    statuses: dict[str, int | None] = {}
    for path in paths:
        request = f"GET {path} HTTP/1.1\r\nHost: coordinator\r\nAuthorization: Bearer {token}"
        raw = (request + "\r\nConnection: close\r\n\r\n").encode()
        statuses[path] = _exchange(rest, source, 30.0, _sends(raw)).status
    return statuses


def trickle(
    rest: str,
    *,
    body: bool = False,
    every_s: float = 0.5,
    give_up_s: float = 60.0,
    source: str = "127.0.0.1",
) -> tuple[float, Answer]:
    """Send a request one byte every `every_s`: its head, or (`body`) a whole head and then
    its declared 1 KiB body. Seconds until the server answered or closed, and what it answered."""
    start = time.monotonic()
    try:
        sock = _connect(rest, source, give_up_s)
    except OSError:
        return time.monotonic() - start, NO_ANSWER
    with sock:
        try:
            if body:
                sock.sendall(
                    b"POST /auth/challenge HTTP/1.1\r\nHost: coordinator\r\n"
                    b"Content-Type: application/json\r\nContent-Length: 1024\r\n\r\n"
                )
            while time.monotonic() - start < give_up_s and not _answered(sock):
                sock.sendall(b"{" if body else b"X")
                time.sleep(every_s)
        except OSError:
            pass
        answer = _read_answer(sock) if _answered(sock) else NO_ANSWER
        return time.monotonic() - start, answer
