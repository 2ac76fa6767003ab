"""What the round loop is doing, for `/health`, `/metrics` and `serve`'s exit status.

The round loop (and `serve` around it) report each change; readers take a snapshot. A loop that
waits for contributors, runs a round or is paused is healthy; one that ended before it was asked
to, crashed, or is being stopped is not, and `reason` says why in one line.

    state      healthy  meaning
    starting   yes      the loop has not run yet (serve is loading the model)
    waiting    yes      waiting up to `wait_for_clients_s` for `min_clients` contributors
    running    yes      a round is open, being collected, aggregated or published
    finished   yes      the configured `rounds` are done (`serve --stay` keeps answering)
    stopping   no       a signal asked serve to stop; the open round is being closed
    stopped    no       the loop ended before its rounds were done (no contributors came)
    crashed    no       the loop raised; the log has the traceback
    stuck      no       the loop did not end within `serve`'s stop bound after a signal

Once `stopping`, the state changes only to `crashed` or `stuck`: what the loop reports while it
winds down does not make a stopping coordinator look healthy again.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Literal

LoopState = Literal[
    "starting", "waiting", "running", "finished", "stopping", "stopped", "crashed", "stuck"
]
HEALTHY: frozenset[str] = frozenset({"starting", "waiting", "running", "finished"})
_AFTER_STOPPING: frozenset[str] = frozenset({"crashed", "stuck"})


@dataclass(frozen=True)
class LoopStatus:
    state: LoopState
    reason: str = ""

    @property
    def healthy(self) -> bool:
        return self.state in HEALTHY


class LoopHealth:
    """The round loop's state. Thread-safe; nothing here blocks or does I/O."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._status = LoopStatus("starting")

    def set(self, state: LoopState, reason: str = "") -> None:
        with self._lock:
            if self._status.state == "stopping" and state not in _AFTER_STOPPING:
                return
            self._status = LoopStatus(state, reason)

    def status(self) -> LoopStatus:
        with self._lock:
            return self._status
