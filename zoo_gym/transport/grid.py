"""Flower's Grid over the zoo-gym gRPC transport.

`GrpcGrid` is what a Flower ServerApp sees in deployment: pushing a Message
puts it in the destination node's mailbox, the contributor's `join` process
pulls it over gRPC, runs its ClientApp and streams the reply up; the servicer
turns that into a reply Message. The ServerApp code is unchanged between this
Grid, the loopback Grid and Flower's simulation engine.
"""

from __future__ import annotations

from collections.abc import Iterable

from flwr.app import Message, RecordDict
from flwr.serverapp import Grid

from zoo_gym.core.protocol import TASK_CONFIG, TaskConfig
from zoo_gym.transport.flower_internals import Run, assign_message_id
from zoo_gym.transport.mailbox import Mailbox, PendingTask


class RunGrid(Grid):
    """What every zoo-gym Grid shares: the run it serves and plain message construction."""

    def __init__(self, *, run_id: int = 1) -> None:
        self._run = Run.create_empty(run_id)

    def set_run(self, run: Run) -> None:
        self._run = run

    @property
    def run(self) -> Run:
        return self._run

    def create_message(
        self,
        content: RecordDict,
        message_type: str,
        dst_node_id: int,
        group_id: str,
        ttl: float | None = None,
    ) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)


class GrpcGrid(RunGrid):
    def __init__(self, mailbox: Mailbox, *, run_id: int = 1) -> None:
        super().__init__(run_id=run_id)
        self.mailbox = mailbox

    def get_node_ids(self) -> Iterable[int]:
        return self.mailbox.online()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids: list[str] = []
        for message in messages:
            assign_message_id(message)
            config = message.content.config_records.get(TASK_CONFIG)
            if config is None:
                task = PendingTask(message, 0, "", 0)
            else:
                t = TaskConfig.from_record(config)
                task = PendingTask(message, t.round, t.base_version, t.deadline_ms)
            self.mailbox.put(message.metadata.dst_node_id, task)
            ids.append(message.metadata.message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self.mailbox.collect(set(message_ids))

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        """Push `messages` and wait up to `timeout` for their replies, or until the mailbox is
        closed (the coordinator is stopping); what did not arrive is withdrawn."""
        ids = set(self.push_messages(messages))
        self.mailbox.wait_replies(ids, timeout)
        replies = self.mailbox.collect(ids)
        self.mailbox.withdraw(ids - {m.metadata.reply_to_message_id for m in replies})
        return replies
