"""An in-process Grid: the same ServerApp and ClientApps, no sockets.

Each pushed Message is handed to its node's ClientApp in this process; the
reply goes through the coordinator's intake (`FederationBackend.receive`)
exactly as an upload over gRPC does, so validation, the ledger and the round
loop are the code that runs in deployment. Rounds take milliseconds plus
training time, which makes this the Grid for tests and for sweeps.

With `intake=False` the Grid returns the ClientApps' raw replies, for a wrapper
(the simulator's adversary) that looks at them before `submit_to_intake`.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from zoo_gym.transport.backend import FederationBackend
from zoo_gym.transport.flower_internals import assign_message_id
from zoo_gym.transport.grid import RunGrid
from zoo_gym.transport.records import unpack_reply


class LoopbackGrid(RunGrid):
    def __init__(
        self,
        backend: FederationBackend,
        nodes: dict[int, tuple[ClientApp, Context]],
        *,
        spool: Path,
        workers: int = 1,
        run_id: int = 1,
        tamper: Callable[[int, Message], Message] | None = None,
        intake: bool = True,
    ) -> None:
        self.backend = backend
        self.intake = intake
        self.nodes = nodes
        self.spool = spool
        self.workers = workers
        self.tamper = tamper
        super().__init__(run_id=run_id)
        self._replies: dict[str, Message] = {}
        spool.mkdir(parents=True, exist_ok=True)

    def get_node_ids(self) -> Iterable[int]:
        return sorted(self.nodes)

    def _deliver(self, message: Message) -> Message | None:
        node_id = message.metadata.dst_node_id
        app, context = self.nodes[node_id]
        reply = app(message, context)
        if self.tamper is not None:
            reply = self.tamper(node_id, reply)
        if not self.intake:
            return reply
        return submit_to_intake(self.backend, self.spool, node_id, reply, message)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        batch = list(messages)
        for message in batch:
            assign_message_id(message)
        with ThreadPoolExecutor(max_workers=self.workers) as pool:
            replies = list(pool.map(self._deliver, batch))
        for message, reply in zip(batch, replies, strict=True):
            if reply is not None:
                self._replies[message.metadata.message_id] = reply
        return [m.metadata.message_id for m in batch]

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return [self._replies.pop(m) for m in message_ids if m in self._replies]

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        return list(self.pull_messages(self.push_messages(messages)))


def submit_to_intake(
    backend: FederationBackend, spool: Path, node_id: int, reply: Message, request: Message
) -> Message:
    """Run a ClientApp's `reply` through the coordinator's intake, as an upload over gRPC.

    The payload is spooled to a file the way the gRPC servicer spools a stream; the
    returned Message is what the ServerApp sees: the intake's verdict, no payload.
    """
    if reply.has_error():
        return reply
    sub, payload, rest = unpack_reply(reply)
    fd, name = tempfile.mkstemp(dir=spool, suffix=".part")
    path = Path(name)
    try:
        with open(fd, "wb") as fh:
            fh.write(payload)
        _, server_content = backend.receive(sub, path, rest, node_id=node_id)
    finally:
        path.unlink(missing_ok=True)
    return Message(server_content, reply_to=request)
