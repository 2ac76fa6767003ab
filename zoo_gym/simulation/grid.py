"""The Grid a simulated federation's coordinator sees.

`SimulationGrid` wraps the Grid that actually runs the ClientApps (the loopback Grid
with `intake=False`, or the Grid of Flower's simulation engine) and adds what a
simulation needs on top of the deployment code:

- node ids: the coordinator addresses contributors by the node id of their registered
  key; `routes` maps those to the inner Grid's node ids (the identity in-process, the
  engine's random ids under Ray);
- Byzantine nodes: with an `Adversary`, nodes in `adversary.identities` never train;
  their replies are crafted from the round's honest replies before anything reaches
  the coordinator;
- intake: every reply, honest or not, then goes through the coordinator's intake
  exactly as an upload over gRPC does.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

from flwr.app import Message
from flwr.serverapp import Grid

from zoo_gym.simulation.adversary import Adversary
from zoo_gym.transport.backend import FederationBackend
from zoo_gym.transport.flower_internals import assign_message_id
from zoo_gym.transport.grid import RunGrid
from zoo_gym.transport.loopback import submit_to_intake


class IntakeGrid(RunGrid):
    """What every simulated federation's Grid shares: the coordinator's node ids (`routes`
    and the adversary's keys), and each reply of `_answer` kept for `pull_messages`."""

    def __init__(
        self,
        backend: FederationBackend,
        *,
        routes: Mapping[int, int],
        spool: Path,
        adversary: Adversary | None = None,
        run_id: int = 1,
    ) -> None:
        super().__init__(run_id=run_id)
        self.backend = backend
        self.routes = dict(routes)  # coordinator node id -> the node id of what trains
        self.spool = spool
        self.adversary = adversary
        self._replies: dict[str, Message] = {}
        spool.mkdir(parents=True, exist_ok=True)

    def get_node_ids(self) -> Iterable[int]:
        byzantine = self.adversary.identities if self.adversary else {}
        return sorted({*self.routes, *byzantine})

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self._exchange(list(messages), timeout=None)

    def _exchange(self, batch: list[Message], *, timeout: float | None) -> list[str]:
        for message in batch:
            assign_message_id(message)
        for message, reply in zip(batch, self._answer(batch, timeout), strict=True):
            if reply is not None:
                self._replies[message.metadata.message_id] = reply
        return [m.metadata.message_id for m in batch]

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return [self._replies.pop(m) for m in message_ids if m in self._replies]

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        return list(self.pull_messages(self._exchange(list(messages), timeout=timeout)))

    def _answer(self, batch: list[Message], timeout: float | None) -> list[Message | None]:
        """The intake's reply to each message of `batch` (None where none came), in order."""
        raise NotImplementedError


class SimulationGrid(IntakeGrid):
    """`IntakeGrid` over a Grid that runs the ClientApps (see the module docstring)."""

    def __init__(
        self,
        inner: Grid,
        backend: FederationBackend,
        *,
        routes: Mapping[int, int],
        spool: Path,
        adversary: Adversary | None = None,
        run_id: int = 1,
    ) -> None:
        super().__init__(backend, routes=routes, spool=spool, adversary=adversary, run_id=run_id)
        self.inner = inner

    def _answer(self, batch: list[Message], timeout: float | None) -> list[Message | None]:
        """Raw replies from the inner Grid and the adversary, then intake, in `batch` order."""
        byzantine = self.adversary.identities if self.adversary else {}
        honest = [m for m in batch if m.metadata.dst_node_id not in byzantine]
        forwarded = {
            id(m): Message(
                m.content,
                self.routes[m.metadata.dst_node_id],
                m.metadata.message_type,
                ttl=m.metadata.ttl,
                group_id=m.metadata.group_id,
            )
            for m in honest
        }
        inner_replies = list(self.inner.send_and_receive(list(forwarded.values()), timeout=timeout))
        by_request = {r.metadata.reply_to_message_id: r for r in inner_replies}
        raw: dict[int, Message] = {}
        for m in honest:
            reply = by_request.get(forwarded[id(m)].metadata.message_id)
            if reply is not None:
                raw[id(m)] = reply
        attacked = [m for m in batch if m.metadata.dst_node_id in byzantine]
        if self.adversary is not None and attacked:
            honest_replies = [raw[id(m)] for m in honest if id(m) in raw]
            for m, reply in zip(
                attacked, self.adversary.replies(honest_replies, attacked), strict=True
            ):
                raw[id(m)] = reply
        return [
            submit_to_intake(self.backend, self.spool, m.metadata.dst_node_id, raw[id(m)], m)
            if id(m) in raw
            else None
            for m in batch
        ]
