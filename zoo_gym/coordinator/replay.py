"""Single use of a signed call's nonce.

A signed call is accepted while its timestamp is within `clock_skew_s` of the coordinator's
clock, which is a window of 2 x `clock_skew_s` of coordinator time. `NonceCache` remembers every
(contributor, nonce) it accepted for that long plus a margin, so a captured call sent again inside
the window is refused; after it, the clock check refuses it.

Memory is bounded: at most `per_contributor` nonces per contributor and `max_entries` in all,
oldest out. Eviction must not reopen a replay, so the cache keeps, per contributor, the newest
timestamp it evicted early (a floor): a later call of that contributor stamped at or before its
floor is refused too. An honest client stamps its calls with its own clock as it makes them, so
the calls that lose to a floor are ones it made long before (thousands of calls ago); it retries
with a fresh stamp. Only the caller's own verified calls move its floor.

Callers record a nonce only after the call's signature verified, so a stranger can neither fill
the cache nor push anyone's nonces out of it.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable

MARGIN_S = 10.0


class NonceCache:
    """Thread-safe record of accepted (contributor, nonce) pairs; `admit` is the only entry point."""

    def __init__(
        self,
        clock_skew_s: float,
        *,
        per_contributor: int = 1024,
        max_entries: int = 50_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if per_contributor < 1 or max_entries < 1:
            raise ValueError("the nonce cache needs room for at least one nonce")
        self.retention_s = 2 * clock_skew_s + MARGIN_S
        self.per_contributor = per_contributor
        self.max_entries = max_entries
        self.clock = clock
        self._lock = threading.Lock()
        # (contributor, nonce) -> (forget at, call's timestamp_ms); insertion order = expiry order
        self._entries: OrderedDict[tuple[str, bytes], tuple[float, int]] = OrderedDict()
        self._by_contributor: dict[str, deque[bytes]] = {}
        # contributor -> (newest timestamp_ms evicted early, forget at); ordered by forget at
        self._floors: OrderedDict[str, tuple[int, float]] = OrderedDict()

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def admit(self, contributor_id: str, nonce: bytes, timestamp_ms: int) -> bool:
        """Record the nonce of a verified call: True the first time, False for a replay.

        False also for a call stamped at or before the contributor's floor (see the module
        docstring), which the cache can no longer tell from a replay.
        """
        now = self.clock()
        key = (contributor_id, nonce)
        with self._lock:
            self._expire(now)
            if key in self._entries:
                return False
            floor = self._floors.get(contributor_id)
            if floor is not None and timestamp_ms <= floor[0]:
                return False
            self._entries[key] = (now + self.retention_s, timestamp_ms)
            nonces = self._by_contributor.setdefault(contributor_id, deque())
            nonces.append(nonce)
            if len(nonces) > self.per_contributor:
                self._evict(contributor_id, nonces[0], now)
            while len(self._entries) > self.max_entries:
                oldest = next(iter(self._entries))
                self._evict(*oldest, now)
            return True

    def _expire(self, now: float) -> None:
        while self._entries:
            key, (forget_at, _) = next(iter(self._entries.items()))
            if forget_at > now:
                break
            self._remove(*key)
        while self._floors:
            contributor, (_, forget_at) = next(iter(self._floors.items()))
            if forget_at > now:
                break
            del self._floors[contributor]

    def _evict(self, contributor_id: str, nonce: bytes, now: float) -> None:
        """Drop a nonce before its time; its timestamp becomes the contributor's floor."""
        timestamp_ms = self._remove(contributor_id, nonce)
        previous = self._floors.pop(contributor_id, None)
        if previous is not None:
            timestamp_ms = max(timestamp_ms, previous[0])
        self._floors[contributor_id] = (timestamp_ms, now + self.retention_s)
        while len(self._floors) > self.max_entries:
            self._floors.popitem(last=False)

    def _remove(self, contributor_id: str, nonce: bytes) -> int:
        """Forget one nonce (the oldest of its contributor); returns its call's timestamp_ms."""
        _, timestamp_ms = self._entries.pop((contributor_id, nonce))
        nonces = self._by_contributor[contributor_id]
        nonces.popleft()
        if not nonces:
            del self._by_contributor[contributor_id]
        return timestamp_ms
