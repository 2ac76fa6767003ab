"""Connection and request limits of the federation service.

Every call is admitted by a `CallGate` before the server reads anything from it, and checked in
this order, each refusal a RESOURCE_EXHAUSTED with one line naming the limit and when to retry:

1. open calls on the whole server (`max_open_calls`);
2. per address (an IPv4 address, or the /64 prefix of an IPv6 one): open calls
   (`max_concurrent_per_peer`) and request rate (`peer_rate_per_s`, `peer_burst`);
3. calls that have not yet signed in (their first message has not been authenticated), in total
   (`max_unauthenticated_calls`) and per address (`max_unauthenticated_per_peer`);
4. once signed in, per contributor key: open calls (`max_calls_per_contributor`) and request rate
   (`contributor_rate_per_s`, `contributor_burst`).

Blocking work (database, signature checks, file I/O, decoding) runs on a bounded pool of
`workers` threads; `WorkerShares` lets one address hold at most `workers_per_peer` of them and one
contributor at most `workers_per_contributor`, so nobody can occupy the pool. A token bucket per
key refills at `rate` tokens per second up to `burst`; bucket tables are bounded (least recently
used keys first out).
"""

from __future__ import annotations

import asyncio
import ipaddress
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

RETRY_OPEN_S = 5.0  # what a refusal for too many open calls suggests waiting


@dataclass(frozen=True)
class RateLimits:
    """Limits of the gRPC service. For rates and open calls 0 turns a limit off (tests only:
    `coordinator.toml` keeps every one on)."""

    peer_rate_per_s: float = 100.0
    peer_burst: int = 400
    contributor_rate_per_s: float = 10.0
    contributor_burst: int = 50
    max_concurrent_per_peer: int = 512
    max_open_calls: int = 4096
    max_unauthenticated_calls: int = 1024
    max_unauthenticated_per_peer: int = 64
    max_calls_per_contributor: int = 4
    workers: int = 8
    workers_per_peer: int = 4
    workers_per_contributor: int = 2
    first_message_timeout_s: float = 10.0
    upload_idle_timeout_s: float = 30.0
    refusal_delay_s: float = 1.0


MAX_PACED = 1024
"""Refusals a `RefusalPacer` holds at once; past that they are answered at once."""


class RefusalPacer:
    """Answer refusals after `delay_s`, at most `max_waiting` of them at once.

    A caller refused for asking too often and asking again at once costs the service a little
    each time; one answered after a delay asks at most once per delay per call it keeps open
    (and its open calls are bounded), so a flood paces itself. The wait is a sleeping task, no
    thread. Used by one event loop only.
    """

    def __init__(self, delay_s: float, *, max_waiting: int = MAX_PACED) -> None:
        self.delay_s = delay_s
        self.max_waiting = max_waiting
        self.waiting = 0

    async def pause(self) -> None:
        if self.delay_s <= 0 or self.waiting >= self.max_waiting:
            return
        self.waiting += 1
        try:
            await asyncio.sleep(self.delay_s)
        finally:
            self.waiting -= 1


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

    def wait(self, key: str, *, keep: float = 0.0) -> float:
        """Seconds until `key` has a token above `keep` (0.0: it has one now), taking nothing."""
        if self.rate <= 0:
            return 0.0
        now = self.clock()
        with self._lock:
            tokens, at = self._buckets.get(key, (self.burst, now))
        tokens = min(self.burst, tokens + (now - at) * self.rate)
        return 0.0 if tokens >= 1.0 + keep else (1.0 + keep - tokens) / self.rate

    def take(self, key: str, *, keep: float = 0.0) -> float:
        """Take one of `key`'s tokens, unless that would leave fewer than `keep`: 0.0 (taken) or
        the seconds until one can be taken."""
        if self.rate <= 0:
            return 0.0
        now = self.clock()
        with self._lock:
            tokens, at = self._buckets.pop(key, (self.burst, now))
            tokens = min(self.burst, tokens + (now - at) * self.rate)
            wait = 0.0 if tokens >= 1.0 + keep else (1.0 + keep - tokens) / self.rate
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


def peer_key(peer: str) -> str:
    """What limits count a gRPC peer as: its IPv4 address, or its IPv6 /64 prefix.

    One host on IPv6 usually holds a whole /64, so counting single IPv6 addresses would let it
    take a fresh allowance per address. An IPv4-mapped IPv6 address counts as the IPv4 one.
    """
    host = peer_host(peer)
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network(f"{ip}/64", strict=False))
    return str(ip)


class Refused(Exception):
    """A call over one of the limits; the message is the line the caller gets."""


@dataclass(eq=False)
class Admission:
    """One admitted call: its address and, once signed in and counted, its contributor."""

    peer: str
    contributor: str = ""
    anonymous: bool = True
    closed: bool = False


def _over(cap: int, count: int) -> bool:
    return cap > 0 and count >= cap


class CallGate:
    """Open-call and rate accounting of one server (used from its event loop's thread only)."""

    def __init__(self, limits: RateLimits, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self.peer_rate = TokenBuckets(limits.peer_rate_per_s, limits.peer_burst, clock=clock)
        self.contributor_rate = TokenBuckets(
            limits.contributor_rate_per_s, limits.contributor_burst, clock=clock
        )
        self.open_calls = 0
        self.unauthenticated = 0
        self.per_peer: Counter[str] = Counter()
        self.unauthenticated_per_peer: Counter[str] = Counter()
        self.per_contributor: Counter[str] = Counter()

    def admit(self, peer: str) -> Admission:
        """Count a new call from `peer` (see `peer_key`) as open and not yet signed in."""
        lim = self.limits
        if _over(lim.max_open_calls, self.open_calls):
            raise Refused(
                f"the coordinator has {lim.max_open_calls} calls open (its limit); "
                f"retry in {RETRY_OPEN_S:g} s"
            )
        if _over(lim.max_concurrent_per_peer, self.per_peer[peer]):
            raise Refused(
                f"{peer} already has {lim.max_concurrent_per_peer} calls open (the limit); "
                f"finish or cancel some and retry in {RETRY_OPEN_S:g} s"
            )
        wait = self.peer_rate.take(peer)
        if wait > 0:
            raise Refused(
                f"too many requests from {peer} ({lim.peer_rate_per_s:g}/s allowed); "
                f"retry in {wait:.1f} s"
            )
        if _over(lim.max_unauthenticated_calls, self.unauthenticated):
            raise Refused(
                f"{lim.max_unauthenticated_calls} calls are waiting to sign in (the limit); "
                f"retry in {RETRY_OPEN_S:g} s"
            )
        if _over(lim.max_unauthenticated_per_peer, self.unauthenticated_per_peer[peer]):
            raise Refused(
                f"{peer} has {lim.max_unauthenticated_per_peer} calls that have not signed in "
                f"(the limit); send each call's request at once, retry in {RETRY_OPEN_S:g} s"
            )
        self.open_calls += 1
        self.per_peer[peer] += 1
        self.unauthenticated += 1
        self.unauthenticated_per_peer[peer] += 1
        return Admission(peer)

    def sign_in(self, call: Admission, contributor: str) -> None:
        """`call` proved it speaks for `contributor`: count it there instead of as anonymous."""
        if call.closed or not call.anonymous:
            return
        self._leave_anonymous(call)
        cap = self.limits.max_calls_per_contributor
        if _over(cap, self.per_contributor[contributor]):
            raise Refused(
                f"contributor {contributor[:12]} already has {cap} calls open (the limit); "
                f"finish some and retry in {RETRY_OPEN_S / 2:g} s"
            )
        self.per_contributor[contributor] += 1
        call.contributor = contributor
        # counted only once the caller proved its key, so nobody can spend another's allowance
        wait = self.contributor_rate.take(contributor)
        if wait > 0:
            raise Refused(
                f"too many requests from contributor {contributor[:12]} "
                f"({self.limits.contributor_rate_per_s:g}/s allowed); retry in {wait:.1f} s"
            )

    def close(self, call: Admission) -> None:
        """The call ended (or was replaced); idempotent."""
        if call.closed:
            return
        call.closed = True
        if call.contributor:
            _decrement(self.per_contributor, call.contributor)
        if call.anonymous:
            self._leave_anonymous(call)
        self.open_calls -= 1
        _decrement(self.per_peer, call.peer)

    def _leave_anonymous(self, call: Admission) -> None:
        call.anonymous = False
        self.unauthenticated -= 1
        _decrement(self.unauthenticated_per_peer, call.peer)


def _decrement(counter: Counter[str], key: str) -> None:
    counter[key] -= 1
    if counter[key] <= 0:
        del counter[key]


class WorkerShares:
    """Runs blocking work on `executor`, at most `workers` jobs at once, of which one address may
    hold `per_peer` and one contributor `per_contributor`; the rest wait their turn (in the event
    loop, holding no thread)."""

    def __init__(self, executor: Executor, *, workers: int, per_peer: int, per_contributor: int):
        self.executor = executor
        self.caps = (workers, per_peer or workers, per_contributor or workers)
        self.busy = 0
        self.busy_peer: Counter[str] = Counter()
        self.busy_contributor: Counter[str] = Counter()
        self._cond: asyncio.Condition | None = None

    def _free(self, peer: str, contributor: str) -> bool:
        total, per_peer, per_contributor = self.caps
        return (
            self.busy < total
            and self.busy_peer[peer] < per_peer
            and (not contributor or self.busy_contributor[contributor] < per_contributor)
        )

    async def run(self, call: Admission, work: Callable[[], T]) -> T:
        """`work()` on a worker thread once `call`'s address and contributor have a share free."""
        cond = self._cond = self._cond or asyncio.Condition()
        contributor = call.contributor
        async with cond:
            await cond.wait_for(lambda: self._free(call.peer, contributor))
            self.busy += 1
            self.busy_peer[call.peer] += 1
            if contributor:
                self.busy_contributor[contributor] += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self.executor, work)
        finally:
            async with cond:
                self.busy -= 1
                _decrement(self.busy_peer, call.peer)
                if contributor:
                    _decrement(self.busy_contributor, contributor)
                cond.notify_all()
