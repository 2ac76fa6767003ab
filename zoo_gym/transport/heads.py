"""Uvicorn's h11 protocol as both HTTP servers run it (the coordinator's REST API and
`gym-serve`): a whole request head within a deadline, and a share of the connections per address.

Uvicorn's h11 protocol bounds the request line and headers in size
(`h11_max_incomplete_event_size`) but waits for them for ever, so clients sending a byte every
few seconds (slowloris) hold connections as long as they like. `guarded_h11` closes a connection
that has not sent a whole head within the deadline of opening, or of its last answer on a
kept-alive connection. A request whose head has arrived is never cut off by it, however long its
body or its answer takes (the body has a deadline of its own: `bodies.read_body`).

Nor does uvicorn bound how many connections one address holds: one that sends whole requests,
sits in keep-alive or reads a long stream can open as many as the process has descriptors and
starve everyone else. `guarded_h11` counts open connections per address (an IPv4 address, or
the /64 prefix of an IPv6 one: `limits.peer_key`) and closes a connection from an address that
already holds `max_per_address`, before reading anything from it, with a one-line 503 that the
client may read. Each refused address is logged at most once a minute.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, ClassVar

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from zoo_gym.transport.limits import RETRY_OPEN_S, peer_key

log = logging.getLogger(__name__)

LOG_EVERY_S = 60.0
"""A refused address is logged at most once in this many seconds."""
MAX_LOGGED = 4096
"""Refused addresses remembered for the logging; past it those logged long ago are forgotten."""


class AddressShares:
    """Open connections per address of one server, at most `max_per_address` each.

    Used from the server's event loop only.
    """

    def __init__(self, max_per_address: int, *, clock: Callable[[], float] = time.monotonic):
        self.max_per_address = max_per_address
        self.open: Counter[str] = Counter()
        self.refused: Counter[str] = Counter()  # refusals not yet logged, per address
        self.logged: dict[str, float] = {}  # address -> when its refusals were last logged
        self.clock = clock

    def admit(self, address: str) -> bool:
        """Count a new connection from `address`, or (False) refuse it: it holds its share."""
        if self.open[address] >= self.max_per_address:
            self._refuse(address)
            return False
        self.open[address] += 1
        return True

    def release(self, address: str) -> None:
        """A connection `admit` counted has closed."""
        self.open[address] -= 1
        if self.open[address] <= 0:
            del self.open[address]

    def _refuse(self, address: str) -> None:
        self.refused[address] += 1
        now = self.clock()
        if now - self.logged.get(address, -LOG_EVERY_S) < LOG_EVERY_S:
            return
        log.warning(
            "refused %d connection(s) from %s, which holds %d, the most one address may "
            "(logged at most once a minute per address)",
            self.refused.pop(address),
            address,
            self.max_per_address,
        )
        if len(self.logged) >= MAX_LOGGED:  # those logged over a minute ago are logged afresh
            self.logged = {a: t for a, t in self.logged.items() if now - t < LOG_EVERY_S}
            self.refused = Counter({a: n for a, n in self.refused.items() if a in self.logged})
        self.logged[address] = now


def refusal(max_per_address: int) -> bytes:
    """The 503 a connection over its address's share gets before it is closed."""
    body = (
        f"too many connections from your address ({max_per_address} open, the most one "
        f"address may); close some and retry in {RETRY_OPEN_S:g} s\n"
    ).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain; charset=utf-8\r\n"
        f"content-length: {len(body)}\r\nretry-after: {RETRY_OPEN_S:g}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


class GuardedH11(H11Protocol):
    """uvicorn's h11 protocol with a head deadline and a share of connections per address;
    `guarded_h11` makes one subclass per server, whose connections share its `shares`."""

    head_timeout_s: ClassVar[float]
    shares: ClassVar[AddressShares]
    refusal: ClassVar[bytes]
    head_timer: asyncio.TimerHandle | None = None
    address: str | None = None  # what the connection is counted under while open

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        address = peer_key(self.client[0]) if self.client else None
        if address is not None and not self.shares.admit(address):
            transport.write(self.refusal)
            transport.close()
            return
        self.address = address
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
        if self.address is not None:
            self.shares.release(self.address)
            self.address = None
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
        self.head_timer = self.loop.call_later(self.head_timeout_s, self._late)

    def _late(self) -> None:
        # IDLE: no whole head since the timer was armed (a request in progress is not)
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.timeout_keep_alive_handler()


def guarded_h11(head_timeout_s: float, max_per_address: int) -> type[GuardedH11]:
    """uvicorn's h11 protocol (`uvicorn.Config(http=...)`) for one server: it closes a connection
    that has not sent a whole request head within `head_timeout_s` of opening or of its last
    answer, and one from an address that already holds `max_per_address` open connections."""

    class Guarded(GuardedH11):
        pass

    Guarded.head_timeout_s = head_timeout_s
    Guarded.shares = AddressShares(max_per_address)
    Guarded.refusal = refusal(max_per_address)
    return Guarded
