"""A contributor's connection to its coordinator, kept across the coordinator's restarts.

`gym-client join` runs for days, and the coordinator behind it is upgraded, restarted or briefly
out of reach. A call that cannot reach it waits (1 s, doubling to 30 s, each wait jittered by
±20% so that a restarted coordinator's contributors do not all return in the same instant; for up
to `reconnect_for_s` in all), registers again, checks that the coordinator still signs with the key
it had, and is made again. A refusal (the coordinator answered, and said no) is never retried.
A coordinator that is busy (RESOURCE_EXHAUSTED: one of its limits on open calls or request rates
is full, perhaps because someone floods it) is treated like an outage, waiting at least as long
as it asked ("retry in N s"), on first contact too.

A submission whose connection dropped may or may not have landed. Before sending it again, the
link asks the coordinator for this contributor's decision in that round, so an update it already
holds is not sent twice.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from flwr.app import Message

from zoo_gym.core.protocol import Registration
from zoo_gym.transport.client import FederationClient, ReceivedTask, SubmitResult, TransportError
from zoo_gym.transport.records import unpack_reply

T = TypeVar("T")

RETRY_FIRST_S = 1.0
RETRY_MAX_S = 30.0
JITTER = 0.2


class Link:
    def __init__(
        self,
        client: FederationClient,
        name: str,
        *,
        reconnect_for_s: float,
        stop: threading.Event | None = None,
        say: Callable[[str], None] = print,
        invite: str = "",
    ) -> None:
        self.client = client
        self.name = name
        self.invite = invite  # the operator's invitation code, sent with every registration
        self.reconnect_for_s = reconnect_for_s
        self.stop = stop or threading.Event()
        self.say = say
        self.registration: Registration | None = None

    def register(self) -> Registration:
        """First contact. Retried only while the coordinator says it is busy: a wrong address
        must fail at once, not hang."""
        give_up = time.monotonic() + self.reconnect_for_s
        delay = RETRY_FIRST_S
        while True:
            try:
                self.registration = self.client.register(self.name, self.invite)
                return self.registration
            except TransportError as exc:
                remaining = give_up - time.monotonic()
                if not _busy(exc) or remaining <= 0:
                    raise
                delay = max(delay, exc.retry_after_s)
                self.say(f"{exc}; trying again in {delay:.0f} s")
                if self._pause(delay, remaining):
                    raise
                delay = min(delay * 2, RETRY_MAX_S)

    def _pause(self, delay: float, remaining: float) -> bool:
        """Wait about `delay` (jittered), at most `remaining`; True when `stop` was set."""
        return self.stop.wait(min(delay * random.uniform(1 - JITTER, 1 + JITTER), remaining))

    def call(self, fn: Callable[[], T]) -> T | None:
        """`fn()`, made again after each outage; None when `stop` was set while waiting."""
        while True:
            try:
                return fn()
            except TransportError as exc:
                if not exc.transient:
                    raise
                if not self.reconnect(exc):
                    return None

    def submit(self, task: ReceivedTask, reply: Message) -> SubmitResult | None:
        """Send `reply` for `task`; None when `stop` was set during an outage.

        After an outage, a refusal (the round closed, or the coordinator restarted and no longer
        knows the task) comes back as a rejected result rather than an error: the contributor
        goes on to the next round.
        """
        try:
            return self.client.submit(task, reply)
        except TransportError as exc:
            if not exc.transient:
                raise
            lost = exc
        size = len(unpack_reply(reply)[1])
        while self.reconnect(lost):
            try:
                held = self.client.outcome(task.round)
                if held.decision == "accepted":
                    self.say(
                        f"round {task.round}: the update had landed before the connection dropped"
                    )
                    return SubmitResult(True, held.reason, 0, size)
                return self.client.submit(task, reply)
            except TransportError as exc:
                if not exc.transient:
                    return SubmitResult(False, str(exc), 0, size)
                lost = exc
        return None

    def reconnect(self, lost: TransportError) -> bool:
        """Wait until the coordinator answers again and register anew; False if `stop` was set.

        Raises TransportError when `reconnect_for_s` runs out, or when the coordinator that
        answers signs with another key than the one this link registered with.
        """
        what = str(lost) if _busy(lost) else f"lost the coordinator ({lost})"
        self.say(f"{what}; retrying for up to {self.reconnect_for_s:g} s")
        give_up = time.monotonic() + self.reconnect_for_s
        delay = max(RETRY_FIRST_S, lost.retry_after_s)
        while True:
            remaining = give_up - time.monotonic()
            if remaining <= 0:
                raise TransportError(
                    f"gave up after {self.reconnect_for_s:g} s: {lost}; run `gym-client join` "
                    "again once it is back, or raise reconnect_for_s",
                    code=lost.code,
                )
            if self._pause(delay, remaining):
                return False
            try:
                registration = self.client.register(self.name, self.invite)
            except TransportError as exc:
                if not exc.transient:
                    raise
                lost, delay = exc, max(min(delay * 2, RETRY_MAX_S), exc.retry_after_s)
                continue
            known = self.registration
            if known is not None and registration.coordinator_key != known.coordinator_key:
                raise TransportError(
                    f"the coordinator at {self.client.target} came back signing with a different "
                    "key than before; nothing more is sent to it (ask its operator)"
                )
            self.registration = registration
            self.say(f"reconnected to {self.client.target}")
            return True


def _busy(exc: TransportError) -> bool:
    """The coordinator answered that one of its limits is full, and said when to retry."""
    return exc.transient and exc.code == "RESOURCE_EXHAUSTED"
