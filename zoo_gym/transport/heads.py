"""A request head sent whole within a deadline, or the connection closed.

What both HTTP servers (the coordinator's REST API and `gym-serve`) run uvicorn with. Its h11
protocol bounds the request line and headers in size (`h11_max_incomplete_event_size`) but waits
for them for ever, so clients sending a byte every few seconds (slowloris) hold connections as
long as they like, up to every one the process can open.

`head_deadline` closes a connection that has not sent a whole head within the deadline of
opening, or of its last answer on a kept-alive connection. A request whose head has arrived is
never cut off by it, however long its body or its answer takes (the body has a deadline of its
own: `bodies.read_body`).
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


def head_deadline(timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol (`uvicorn.Config(http=...)`), closing a connection that has not
    sent a whole request head within `timeout_s` of opening or of its last answer."""

    class HeadDeadline(H11Protocol):
        head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            if self.head_timer is not None:
                self.head_timer.cancel()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self.head_timer is not None:
                self.head_timer.cancel()
            self.head_timer = self.loop.call_later(timeout_s, self._late)

        def _late(self) -> None:
            # IDLE: no whole head since the timer was armed (a request in progress is not)
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.timeout_keep_alive_handler()

    return HeadDeadline
