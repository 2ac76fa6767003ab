"""A real coordinator backend behind the real gRPC server on 127.0.0.1, with rounds opened by hand.

`Wire.open_round` does what the round loop does when a round starts (ledger row, intake's open
round, one task per contributor through the gRPC Grid), so transport tests can submit against
real intake without running training.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from flwr.app import ConfigRecord, RecordDict
from sqlmodel import Session

from zoo_gym import ledger
from zoo_gym.compression import CodecSpec, encode
from zoo_gym.coordinator.config import load_config
from zoo_gym.coordinator.intake import OpenRound
from zoo_gym.coordinator.rounds import lora_spec, update_layout
from zoo_gym.coordinator.service import Coordinator
from zoo_gym.core.delta import Layout
from zoo_gym.core.identity import Identity, node_id
from zoo_gym.core.protocol import TASK_CONFIG, TaskConfig
from zoo_gym.transport.client import FederationClient, ReceivedTask
from zoo_gym.transport.flower_internals import set_task_identity
from zoo_gym.transport.grid import GrpcGrid
from zoo_gym.transport.limits import RateLimits
from zoo_gym.transport.mailbox import Mailbox
from zoo_gym.transport.server import ServerHandle, start_server

UNLIMITED = RateLimits(0, 1, 0, 1, 0)


@dataclass
class Wire:
    co: Coordinator
    server: ServerHandle
    mailbox: Mailbox
    grid: GrpcGrid
    layout: Layout
    clients: list[FederationClient] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    def client(self, identity: Identity | None = None, **kw: object) -> FederationClient:
        c = FederationClient(self.address, identity or Identity.generate(), timeout_s=10, **kw)  # type: ignore[arg-type]
        self.clients.append(c)
        return c

    def handed_task(self, me: Identity, number: int = 1) -> tuple[FederationClient, ReceivedTask]:
        """A client of `me`, registered, holding its task of round `number` (opened for it alone)."""
        client = self.client(me)
        client.register("me")
        self.open_round(number, [me])
        return client, take_task(client)

    def open_round(self, number: int, identities: list[Identity], *, base: str = "v0000") -> None:
        if self.co.backend.open_round is not None:
            self.co.backend.open_round.accepting = False
        with Session(self.co.engine) as s:
            ledger.open_round(
                s, number=number, base_version=base, seed=number, aggregator="fedavg", codec="none"
            )
        deadline_ms = int((time.time() + 600) * 1000)
        task = TaskConfig(
            round=number,
            base_version=base,
            seed=number,
            deadline_ms=deadline_ms,
            **self.co.config.training.task_fields(),
        )
        self.co.backend.open_round = OpenRound(number, base, self.layout, deadline_ms)
        messages = [
            self.grid.create_message(
                RecordDict({TASK_CONFIG: ConfigRecord(task.to_record())}),
                "train",
                node_id(i.public_key),
                str(number),
            )
            for i in identities
        ]
        self.grid.push_messages(messages)

    def payload(self, task: ReceivedTask, *, scale: float = 0.0, codec: str = "none") -> bytes:
        """An envelope of the round's B matrices (all `scale`), in `codec`."""
        delta = {s.name: torch.full(s.shape, scale) for s in self.layout}
        return encode(delta, CodecSpec(codec, 128))

    def rows(self, contributor: Identity) -> list[tuple[int, str, str]]:
        with Session(self.co.engine) as s:
            subs = ledger.list_submissions(s, contributor_id=contributor.contributor_id)
            return [(r.round_number, r.decision, r.reason) for r in subs]

    def close(self) -> None:
        for c in self.clients:
            c.close()
        self.server.stop(0)
        self.co.engine.dispose()


def build_wire(home: Path, *, limits: RateLimits | None = UNLIMITED, settings: str = "") -> Wire:
    """A wire on `home`; `limits=None` serves with start_server's own default limits."""
    set_task_identity(run_id=1, node_id=0, task_id=1)  # as `Coordinator.run` sets them
    config = home / "coordinator.toml"
    if settings:
        config.write_text(config.read_text().replace("[training]", f"{settings}\n\n[training]", 1))
    co = Coordinator(load_config(config))
    mailbox = Mailbox()
    limited = {} if limits is None else {"limits": limits}
    server = start_server(
        co.backend, mailbox, address="127.0.0.1:0", spool=home / "spool", **limited
    )
    state = co.registry.load_state_dict(co.registry.latest().version)
    layout = update_layout(state, lora_spec(co.config.training))
    return Wire(co, server, mailbox, GrpcGrid(mailbox), layout)


def config_of(task: ReceivedTask) -> TaskConfig:
    return TaskConfig.from_record(task.message.content.config_records[TASK_CONFIG])


def take_task(client: FederationClient) -> ReceivedTask:
    task = client.poll(2.0)
    assert task is not None, "no task was handed out"
    return task
