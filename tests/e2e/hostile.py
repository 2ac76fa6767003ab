"""Hostile gRPC callers, for tests that attack a coordinator while honest contributors work.

- `hold_calls`: N calls of any method opened over raw HTTP/2 (the `h2` library on plain sockets)
  whose request never comes: SubmitUpdate streams without their header, or unary calls without
  their message. Sockets are bound to 127.0.0.2, 127.0.0.3, ... (a gRPC channel cannot choose
  its source address), so the attack comes from other addresses than the honest callers.
- `long_polls`: N concurrent long polls from one signed-in contributor.

Both start at once and run in threads of their own; `wait` collects how each call ended, `close`
stops them. Nothing listens; every socket goes to the coordinator on 127.0.0.x.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from urllib.parse import unquote  # grpc-message is percent-encoded

import grpc
import h2.config
import h2.connection
import h2.events
import h2.exceptions

from zoo_gym.core.identity import Identity
from zoo_gym.transport.client import FederationClient, TransportError

SERVICE = "/zoo_gym.v1.Federation/"
GRPC_CODES = {c.value[0]: c.name for c in grpc.StatusCode}


class _Connection:
    """One HTTP/2 connection from `source` holding request-less gRPC calls; a thread reads it."""

    def __init__(self, address: str, source: str) -> None:
        host, port = address.rsplit(":", 1)
        self.authority = address
        self.sock = socket.create_connection(
            (host, int(port)), timeout=30, source_address=(source, 0)
        )
        self.sock.settimeout(None)
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        self.lock = threading.Lock()
        self.ended: dict[int, str] = {}  # stream id -> how it ended ("RESOURCE_EXHAUSTED: ...")
        self.headers: dict[int, dict[bytes, bytes]] = {}
        self.streams: list[int] = []
        with self.lock:
            self.h2.initiate_connection()
            self.sock.sendall(self.h2.data_to_send())
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def open(self, method: str) -> None:
        with self.lock:
            stream = self.h2.get_next_available_stream_id()
            self.h2.send_headers(
                stream,
                [
                    (":method", "POST"),
                    (":scheme", "http"),
                    (":path", SERVICE + method),
                    (":authority", self.authority),
                    ("content-type", "application/grpc"),
                    ("te", "trailers"),
                ],
                end_stream=False,
            )
            self.sock.sendall(self.h2.data_to_send())
            self.streams.append(stream)

    def _read(self) -> None:
        while True:
            try:
                data = self.sock.recv(65536)
            except OSError:
                data = b""
            with self.lock:
                if not data:
                    for stream in self.streams:
                        self.ended.setdefault(stream, "connection closed")
                    return
                try:
                    events = self.h2.receive_data(data)
                except h2.exceptions.ProtocolError:
                    events = []
                for event in events:
                    self._note(event)
                with contextlib.suppress(OSError):
                    self.sock.sendall(self.h2.data_to_send())

    def _note(self, event: h2.events.Event) -> None:
        if isinstance(event, h2.events.ResponseReceived | h2.events.TrailersReceived):
            assert event.stream_id is not None and event.headers is not None
            headers = self.headers.setdefault(event.stream_id, {})
            headers.update({_b(k): _b(v) for k, v in event.headers})
        elif isinstance(event, h2.events.DataReceived):
            assert event.stream_id is not None and event.flow_controlled_length is not None
            self.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        elif isinstance(event, h2.events.StreamEnded | h2.events.StreamReset):
            assert event.stream_id is not None
            self.ended.setdefault(event.stream_id, self._status(event))
        elif isinstance(event, h2.events.ConnectionTerminated):
            for stream in self.streams:
                self.ended.setdefault(stream, "connection closed")

    def _status(self, event: h2.events.StreamEnded | h2.events.StreamReset) -> str:
        """The gRPC status the server ended a stream with ("CODE: message"), else how it ended."""
        assert event.stream_id is not None
        headers = self.headers.get(event.stream_id, {})
        if b"grpc-status" not in headers:
            return "reset" if isinstance(event, h2.events.StreamReset) else "ended"
        code = GRPC_CODES.get(int(headers[b"grpc-status"]), "UNKNOWN")
        return f"{code}: {unquote(headers.get(b'grpc-message', b'').decode(errors='replace'))}"

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self.reader.join(timeout=5)


def _b(value: bytes | str) -> bytes:
    return value if isinstance(value, bytes) else value.encode()


@dataclass
class HeldCalls:
    """Calls opened without their request; each ends when the server ends it."""

    connections: list[_Connection] = field(default_factory=list)
    opened: int = 0

    def ended(self) -> list[str]:
        out: list[str] = []
        for conn in self.connections:
            with conn.lock:
                out.extend(conn.ended.values())
        return out

    def codes(self) -> Counter[str]:
        """How many calls ended with each status (or "reset", "connection closed")."""
        return Counter(e.split(":", 1)[0].split(" ", 1)[0] for e in self.ended())

    def wait(self, timeout_s: float) -> list[str]:
        """How the calls ended, waiting up to `timeout_s` for all of them to end."""
        deadline = time.monotonic() + timeout_s
        while len(self.ended()) < self.opened and time.monotonic() < deadline:
            time.sleep(0.1)
        return self.ended()

    def close(self) -> None:
        for conn in self.connections:
            conn.close()


def hold_calls(
    address: str,
    n: int,
    *,
    method: str = "SubmitUpdate",
    sources: tuple[str, ...] = ("127.0.0.2",),
    per_connection: int = 50,
) -> HeldCalls:
    """Open `n` calls of `method` on `address` that never send a message, spread over `sources`."""
    held = HeldCalls()
    per_connection = min(per_connection, -(-n // len(sources)))
    while held.opened < n:
        source = sources[len(held.connections) % len(sources)]
        conn = _Connection(address, source)
        held.connections.append(conn)
        for _ in range(min(per_connection, n - held.opened)):
            conn.open(method)
            held.opened += 1
    return held


class Flood:
    """`hold_calls(address, n, ...)` again every `every_s` seconds until `stop`, from a thread, so
    the pressure outlasts the server's deadline for a first message."""

    def __init__(self, address: str, n: int, *, every_s: float = 5.0, **how: object) -> None:
        self.n = n
        self.batches: list[HeldCalls] = []
        self.errors: list[str] = []
        self._stop = threading.Event()

        def run() -> None:
            while not self._stop.is_set():
                try:
                    self.batches.append(hold_calls(address, n, **how))  # type: ignore[arg-type]
                except OSError as exc:  # the server refused the connection itself
                    self.errors.append(str(exc))
                self._stop.wait(every_s)

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(timeout=30)

    def codes(self) -> Counter[str]:
        total: Counter[str] = Counter()
        for batch in self.batches:
            total += batch.codes()
        return total

    def opened(self) -> int:
        return sum(b.opened for b in self.batches)

    def wait(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for batch in self.batches:
            batch.wait(max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        self.stop()
        for batch in self.batches:
            batch.close()


@dataclass
class Polls:
    """Concurrent long polls of one contributor; `results` says how each ended."""

    threads: list[threading.Thread]
    results: list[str]
    client: FederationClient
    stop: threading.Event

    def wait(self, timeout_s: float) -> list[str]:
        deadline = time.monotonic() + timeout_s
        for t in self.threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        return list(self.results)

    def close(self) -> None:
        self.stop.set()
        self.wait(40)
        self.client.close()


def long_polls(
    address: str,
    n: int,
    *,
    wait_s: float = 30.0,
    repeat: bool = False,
    identity: Identity | None = None,
) -> Polls:
    """`n` long polls at once from one contributor (registered here first), each in a thread;
    with `repeat` each thread polls again (a second after each answer) until `close`."""
    me = identity or Identity.generate()
    client = FederationClient(address, me, timeout_s=10)
    client.register("poller")
    results: list[str] = []
    stop = threading.Event()

    def poll() -> None:
        while True:
            try:
                results.append("task" if client.poll(wait_s) is not None else "idle")
            except TransportError as exc:
                results.append(f"{exc.code}: {exc}")
            if not repeat or stop.wait(1.0):
                return

    threads = [threading.Thread(target=poll, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    return Polls(threads, results, client, stop)
