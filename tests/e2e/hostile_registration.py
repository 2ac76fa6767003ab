"""Registration floods against a real coordinator, for admission and mixed-load tests.

`flood` registers fresh keys as fast as one gRPC channel allows and counts the answers by status
code; it is safe to run from many threads at once (each call has its own channel). `SourceProxy`
forwards one loopback address to the coordinator with its outgoing connections bound to that
address, so a flood through `SourceProxy("127.0.0.7", ...)` reaches the coordinator from
127.0.0.7: many proxies make a flood from many addresses on one machine.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections import Counter
from types import TracebackType

import grpc

from zoo_gym.core.identity import Identity
from zoo_gym.core.protocol import register_statement
from zoo_gym.proto.v1 import federation_pb2 as pb
from zoo_gym.proto.v1 import federation_pb2_grpc as pb_grpc


def register_request(identity: Identity, name: str, invite: str = "") -> pb.RegisterRequest:
    """A signed RegisterRequest for `identity`, with an invitation code when `invite` is set."""
    ts = int(time.time() * 1000)
    return pb.RegisterRequest(
        protocol_version=1,
        public_key=identity.public_key,
        name=name,
        timestamp_ms=ts,
        signature=identity.sign(register_statement(identity.public_key, name, ts)),
        invite=invite,
    )


def register(
    address: str, identity: Identity, name: str = "probe", invite: str = ""
) -> tuple[str, str]:
    """Register once over a fresh channel: ("OK", status) or (status code name, details)."""
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.FederationStub(channel)
        try:
            reply = stub.Register(register_request(identity, name, invite), timeout=10)
        except grpc.RpcError as exc:
            return exc.code().name, str(exc.details())
    return "OK", reply.status


def flood(
    address: str,
    count: int,
    *,
    stop: threading.Event | None = None,
    timeout_s: float = 10.0,
) -> Counter[str]:
    """Register `count` fresh keys at `address` back to back (until `stop` is set); the answers
    counted by status code ("OK" for an admitted key)."""
    answers: Counter[str] = Counter()
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.FederationStub(channel)
        for i in range(count):
            if stop is not None and stop.is_set():
                break
            request = register_request(Identity.generate(), f"sybil-{i}")
            try:
                stub.Register(request, timeout=timeout_s)
                answers["OK"] += 1
            except grpc.RpcError as exc:
                answers[exc.code().name] += 1
    return answers


class SourceProxy:
    """Forward `host`:(free port) to `target` ("127.0.0.1:PORT") from the source address `host`.

    `host` must be a loopback address (127.0.0.x). `address` is what a client dials. Every
    thread and socket started here is closed by `close` (or leaving the `with` block).
    """

    def __init__(self, host: str, target: str) -> None:
        if not host.startswith("127."):
            raise ValueError(f"SourceProxy listens on loopback addresses only, not {host}")
        self.host = host
        target_host, _, target_port = target.rpartition(":")
        self.target = (target_host, int(target_port))
        self._server = socket.create_server((host, 0))
        self._server.settimeout(0.2)
        self.address = f"{host}:{self._server.getsockname()[1]}"
        self._closed = threading.Event()
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                inbound, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            outbound = socket.socket()
            outbound.bind((self.host, 0))
            try:
                outbound.connect(self.target)
            except OSError:
                inbound.close()
                outbound.close()
                continue
            with self._lock:
                self._sockets += [inbound, outbound]
            for a, b in ((inbound, outbound), (outbound, inbound)):
                pump = threading.Thread(target=self._pump, args=(a, b), daemon=True)
                pump.start()
                self._threads.append(pump)

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self._closed.set()
        self._server.close()
        with self._lock:
            for s in self._sockets:
                with contextlib.suppress(OSError):
                    s.close()
        for thread in self._threads:
            thread.join(timeout=5)

    def __enter__(self) -> SourceProxy:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
