"""Per-node task queues and replies between the Grid and the gRPC handlers.

The ServerApp pushes instruction Messages; contributors pull them when they
poll (they sit behind NAT, so the coordinator never dials out). A task stays
assigned to its node until a reply arrives or the Grid withdraws it, so a
contributor that restarts mid-round is handed the same task again. `close` wakes every waiter
for good when the coordinator stops.

`take` blocks its thread while it waits. A server that must not hold a thread per long poll
registers a `watch` callback instead: it is told the node id of every task put (and None once
the mailbox is closed), and takes the task with `take(node_id, 0)`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from flwr.app import Message


@dataclass
class PendingTask:
    message: Message
    round: int
    base_version: str
    deadline_ms: int


class Mailbox:
    def __init__(self, *, online_window_s: float = 30.0) -> None:
        self._cond = threading.Condition()
        self._pending: dict[int, dict[str, PendingTask]] = {}
        self._replies: dict[str, Message] = {}
        self._last_seen: dict[int, float] = {}
        self._closed = False
        self.online_window_s = online_window_s
        self._watchers: list[Callable[[int | None], None]] = []

    def watch(self, callback: Callable[[int | None], None]) -> None:
        """Call `callback(node_id)` (from the putting thread) after every `put`, and
        `callback(None)` on `close`."""
        with self._cond:
            self._watchers.append(callback)

    def unwatch(self, callback: Callable[[int | None], None]) -> None:
        with self._cond:
            if callback in self._watchers:
                self._watchers.remove(callback)

    def close(self) -> None:
        """Stop waiting, for good: `take` hands out nothing more and `wait_replies` returns at
        once, so neither the round loop nor a long poll holds a stopping coordinator up."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            watchers = list(self._watchers)
        for callback in watchers:
            callback(None)

    def put(self, node_id: int, task: PendingTask) -> None:
        with self._cond:
            self._pending.setdefault(node_id, {})[task.message.metadata.message_id] = task
            self._cond.notify_all()
            watchers = list(self._watchers)
        for callback in watchers:
            callback(node_id)

    def take(self, node_id: int, wait_s: float) -> PendingTask | None:
        """The oldest task assigned to `node_id`, waiting up to `wait_s` for one."""
        deadline = time.monotonic() + max(0.0, wait_s)
        with self._cond:
            self._last_seen[node_id] = time.monotonic()
            while not self._pending.get(node_id) or self._closed:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._closed:
                    return None
                self._cond.wait(remaining)
            self._last_seen[node_id] = time.monotonic()
            return next(iter(self._pending[node_id].values()))

    def task(self, node_id: int, message_id: str) -> PendingTask | None:
        with self._cond:
            return self._pending.get(node_id, {}).get(message_id)

    def reply(self, node_id: int, message_id: str, reply: Message) -> None:
        with self._cond:
            self._pending.get(node_id, {}).pop(message_id, None)
            self._replies[message_id] = reply
            self._cond.notify_all()

    def withdraw(self, message_ids: set[str]) -> None:
        with self._cond:
            for tasks in self._pending.values():
                for message_id in message_ids & tasks.keys():
                    del tasks[message_id]

    def collect(self, message_ids: set[str]) -> list[Message]:
        with self._cond:
            found = [self._replies.pop(m) for m in list(message_ids) if m in self._replies]
            return found

    def wait_replies(self, message_ids: set[str], timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self._closed and not message_ids <= self._replies.keys():
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return
                self._cond.wait(remaining if remaining is not None else 1.0)

    def online(self) -> list[int]:
        now = time.monotonic()
        with self._cond:
            busy = {n for n, tasks in self._pending.items() if tasks}
            recent = {n for n, t in self._last_seen.items() if now - t <= self.online_window_s}
            return sorted(busy | recent)
