"""Brute-force resistance of the REST API, per client address.

- Sign-in calls (`/auth/challenge`, `/auth/token`) take a token from the caller's bucket
  (`api_auth_rate_per_s`, burst `api_auth_burst`); an empty bucket is answered 429.
- Every bad credential (unknown API key, bad contributor token, wrong challenge signature) counts
  against the caller's address; after `api_max_failures` of them within `api_lockout_s` the address
  is locked out for `api_lockout_s`: every authenticated call from it is answered 429 with
  `Retry-After`, even with a right key, so guessing gains nothing. The count is per address, so a
  lockout never reaches callers from other addresses.

Addresses are the socket peer (`request.client.host`); a proxy in front must keep its own limits.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import HTTPException, Request, status

from zoo_gym.transport.limits import TokenBuckets

MAX_ADDRESSES = 100_000


@dataclass
class _Failures:
    count: int
    first: float
    locked_until: float = 0.0


class ApiGuard:
    """Sign-in rate and failed-credential lockout per client address. Thread-safe."""

    def __init__(
        self,
        *,
        auth_rate_per_s: float = 2.0,
        auth_burst: int = 20,
        max_failures: int = 10,
        lockout_s: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_failures = max_failures
        self.lockout_s = lockout_s
        self.clock = clock
        self.sign_in = TokenBuckets(
            auth_rate_per_s, auth_burst, max_keys=MAX_ADDRESSES, clock=clock
        )
        self._failures: OrderedDict[str, _Failures] = OrderedDict()
        self._lock = threading.Lock()

    def locked_for(self, address: str) -> float:
        """Seconds `address` stays locked out (0.0: it is not)."""
        with self._lock:
            entry = self._failures.get(address)
            if entry is None:
                return 0.0
            return max(0.0, entry.locked_until - self.clock())

    def failed(self, address: str) -> None:
        """Count one bad credential from `address`; lock it out at the limit."""
        now = self.clock()
        with self._lock:
            entry = self._failures.pop(address, None)
            if entry is None or (entry.locked_until <= now and now - entry.first > self.lockout_s):
                entry = _Failures(0, now)
            entry.count += 1
            if entry.count >= self.max_failures:
                entry.locked_until = now + self.lockout_s
                entry.count, entry.first = 0, now + self.lockout_s
            self._failures[address] = entry
            while len(self._failures) > MAX_ADDRESSES:
                self._failures.popitem(last=False)


def client_address(request: Request) -> str:
    return request.client.host if request.client is not None else "unknown"


def too_many(detail: str, retry_after_s: float) -> HTTPException:
    return HTTPException(
        status.HTTP_429_TOO_MANY_REQUESTS,
        detail=detail,
        headers={"Retry-After": str(max(1, math.ceil(retry_after_s)))},
    )


def refuse_if_locked(guard: ApiGuard, address: str) -> None:
    wait = guard.locked_for(address)
    if wait > 0:
        raise too_many(
            f"too many bad credentials from {address}; this address is locked out for {wait:.0f} s more",
            wait,
        )


def take_sign_in(guard: ApiGuard, address: str) -> None:
    refuse_if_locked(guard, address)
    wait = guard.sign_in.take(address)
    if wait > 0:
        raise too_many(f"too many sign-in requests from {address}; retry in {wait:.1f} s", wait)
