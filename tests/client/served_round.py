"""A coordinator serving one round on 127.0.0.1: the real gRPC server and the real round loop
(the ServerApp over the gRPC Grid) in this process, as `gym-coordinator serve` runs them.

Helpers live here, not in conftest.py, so that test modules can import them by a unique name.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from sqlmodel import Session

from zoo_gym import ledger
from zoo_gym.client.config import ClientConfig
from zoo_gym.compression import decode
from zoo_gym.coordinator.config import load_config
from zoo_gym.coordinator.serve import run_loop
from zoo_gym.coordinator.service import Coordinator
from zoo_gym.core.delta import Delta
from zoo_gym.core.identity import Identity
from zoo_gym.core.weights import load_weights
from zoo_gym.ledger.models import Submission
from zoo_gym.transport.grid import GrpcGrid
from zoo_gym.transport.limits import RateLimits
from zoo_gym.transport.mailbox import Mailbox
from zoo_gym.transport.server import start_server

ONE_ROUND = {
    "rounds": 1,
    "min_clients": 1,
    "aggregator": '"fedavg"',
    "wait_for_clients_s": 60,
    "round_timeout_s": 120,
}


@dataclass
class Served:
    co: Coordinator
    address: str
    home: Path

    def base(self) -> dict[str, torch.Tensor]:
        """The round's base weights, as the coordinator stores them."""
        return load_weights(self.home / "base")

    def submissions(self, who: Identity) -> list[Submission]:
        with Session(self.co.engine) as s:
            return ledger.list_submissions(s, contributor_id=who.contributor_id)

    def received(self, submission: Submission) -> Delta:
        """The update the coordinator stored for `submission`, decoded."""
        payload = self.co.backend.payload_path(submission.payload_sha256).read_bytes()
        return decode(payload, max_elements=10_000_000)


@contextmanager
def serving(home: Path, training: dict[str, object]) -> Iterator[Served]:
    """The coordinator in `home` serving `ONE_ROUND` with `training` over its [training] table
    (values written as TOML: strings quoted by the caller); stopped and joined on exit."""
    config = home / "coordinator.toml"
    kept = [
        line
        for line in config.read_text().splitlines()
        if line.partition(" = ")[0] not in {*ONE_ROUND, *training}
    ]
    top = [f"{k} = {v}" for k, v in ONE_ROUND.items()]
    table = [f"{k} = {v}" for k, v in training.items()]
    text = "\n".join(kept).replace("[training]", "\n".join([*top, "", "[training]"]), 1)
    config.write_text("\n".join([text, *table, ""]))
    co = Coordinator(load_config(config))
    mailbox = Mailbox()
    server = start_server(
        co.backend,
        mailbox,
        address="127.0.0.1:0",
        spool=home / "spool",
        limits=RateLimits(0, 1, 0, 1, 0),
    )
    loop = threading.Thread(target=run_loop, args=(co, GrpcGrid(mailbox)), daemon=True)
    loop.start()
    try:
        yield Served(co, f"127.0.0.1:{server.port}", home)
    finally:  # as `serve` stops: the open round closes, a waiting long poll returns
        co.stop.set()
        mailbox.close()
        loop.join(timeout=60)
        server.stop(0)
        co.engine.dispose()


def contributor(home: Path, address: str, **settings: object) -> tuple[ClientConfig, Identity]:
    """A contributor's config for one round against `address`, and its identity."""
    home.mkdir(parents=True)
    identity = Identity.generate()
    identity.save(home / "client.key")
    config = ClientConfig.model_validate(
        {
            "home": home,
            "coordinator": address,
            "max_rounds": 1,
            "poll_wait_s": 5.0,
            "reconnect_for_s": 0.0,
            "device": "cpu",
            **settings,
        }
    )
    return config, identity
