"""Connection and request limits of the federation service.

A token bucket per key (a peer's address, or an authenticated contributor) refills at `rate`
tokens per second up to `burst`; a call takes one token or is refused with RESOURCE_EXHAUSTED
and a line saying when to retry. A peer may also hold at most `max_concurrent` calls at once
(a long poll or an upload occupies a server thread for its whole duration). Buckets are kept
for at most `max_keys` keys, least recently used first out, so the table itself is bounded.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc


@dataclass(frozen=True)
class RateLimits:
    """Limits of the gRPC service; 0 turns a limit off."""

    peer_rate_per_s: float = 50.0
    peer_burst: int = 200
    contributor_rate_per_s: float = 10.0
    contributor_burst: int = 50
    max_concurrent_per_peer: int = 64


class TokenBuckets:
    """One token bucket per key. Thread-safe; `take` answers 0.0 (allowed) or seconds to wait."""

    def __init__(
        self,
        rate_per_s: float,
        burst: int,
        *,
        max_keys: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.rate = rate_per_s
        self.burst = float(burst)
        self.max_keys = max_keys
        self.clock = clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # key -> (tokens, at)
        self._lock = threading.Lock()

    def take(self, key: str) -> float:
        if self.rate <= 0:
            return 0.0
        now = self.clock()
        with self._lock:
            tokens, at = self._buckets.pop(key, (self.burst, now))
            tokens = min(self.burst, tokens + (now - at) * self.rate)
            wait = 0.0 if tokens >= 1.0 else (1.0 - tokens) / self.rate
            self._buckets[key] = (tokens - 1.0 if wait == 0.0 else tokens, now)
            while len(self._buckets) > self.max_keys:
                self._buckets.popitem(last=False)
        return wait


def peer_host(peer: str) -> str:
    """The address part of a gRPC peer string ("ipv4:1.2.3.4:5", "ipv6:[::1]:5" -> host)."""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        host = rest.rsplit(":", 1)[0]
        return host.strip("[]")
    return peer


class _Gate:
    """Per-peer rate and concurrency accounting shared by every call of one server."""

    def __init__(self, limits: RateLimits) -> None:
        self.limits = limits
        self.buckets = TokenBuckets(limits.peer_rate_per_s, limits.peer_burst)
        self.active: dict[str, int] = {}
        self.lock = threading.Lock()

    def enter(self, context: grpc.ServicerContext) -> str:
        host = peer_host(context.peer())
        wait = self.buckets.take(host)
        if wait > 0:
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"too many requests from {host} ({self.limits.peer_rate_per_s:g}/s allowed); "
                f"retry in {wait:.1f} s",
            )
        cap = self.limits.max_concurrent_per_peer
        with self.lock:
            busy = self.active.get(host, 0)
            if cap > 0 and busy >= cap:
                refused = True
            else:
                refused = False
                self.active[host] = busy + 1
        if refused:
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{host} already has {cap} calls open (the limit); finish or cancel some and retry",
            )
        return host

    def leave(self, host: str) -> None:
        with self.lock:
            left = self.active.get(host, 1) - 1
            if left > 0:
                self.active[host] = left
            else:
                self.active.pop(host, None)


class RateLimitInterceptor(grpc.ServerInterceptor):  # type: ignore[misc]
    """Refuses a call when its peer is over its request rate or its number of open calls."""

    def __init__(self, limits: RateLimits) -> None:
        self.gate = _Gate(limits)

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        gate = self.gate
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                _guarded(gate, handler.unary_unary),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(
                _guarded(gate, handler.stream_unary),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                _guarded_stream(gate, handler.unary_stream),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler  # stream-stream: the service has none


def _guarded(
    gate: _Gate, behaviour: Callable[[Any, grpc.ServicerContext], Any]
) -> Callable[..., Any]:
    def call(request: Any, context: grpc.ServicerContext) -> Any:
        host = gate.enter(context)
        try:
            return behaviour(request, context)
        finally:
            gate.leave(host)

    return call


def _guarded_stream(
    gate: _Gate, behaviour: Callable[[Any, grpc.ServicerContext], Iterator[Any]]
) -> Callable[..., Iterator[Any]]:
    def call(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        host = gate.enter(context)
        try:
            yield from behaviour(request, context)
        finally:
            gate.leave(host)

    return call
