"""A coordinator's REST API served by uvicorn on 127.0.0.1 for the CLI to talk to.

Helpers live here, not in conftest.py, so that test modules can import them by a unique name.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from pathlib import Path

from sqlmodel import Session
from typer.testing import CliRunner, Result

from zoo_gym import ledger
from zoo_gym.cli.coordinator import app
from zoo_gym.coordinator.service import Coordinator
from zoo_gym.core.identity import Identity


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def gym(*args: str, env: dict[str, str] | None = None) -> Result:
    """Run `gym-coordinator ARGS` in this process."""
    return CliRunner().invoke(app, list(args), env=env)


@dataclass
class Served:
    home: Path
    co: Coordinator
    url: str
    admin: str
    viewer: str
    alice: Identity

    def admin_cli(self, *args: str, token: str | None = None) -> Result:
        return gym("admin", "--url", self.url, "--token", token or self.admin, *args)


def populate(co: Coordinator) -> tuple[Identity, str, str]:
    alice = Identity.generate()
    with Session(co.engine) as s:
        ledger.register_contributor(
            s, contributor_id=alice.contributor_id, public_key=alice.public_key, name="alice"
        )
        ledger.open_round(
            s, number=1, base_version="v0000", seed=1, aggregator="fedavg", codec="bitdelta"
        )
        sub = ledger.record_submission(
            s,
            round_number=1,
            contributor_id=alice.contributor_id,
            nonce="n1",
            base_version="v0000",
            payload_sha256="ab" * 32,
            size_bytes=10,
            decision="accepted",
            reason="accepted at intake",
        )
        assert sub.id is not None
        ledger.record_reward(
            s,
            round_number=1,
            contributor_id=alice.contributor_id,
            quality=0.5,
            amount=3.0,
            reputation_after=0.5,
        )
        ledger.close_round(s, number=1, status="published", metrics={})
        ledger.checkpoint(s, signer=co.signer)  # the round loop signs one at each round's end
        admin = ledger.create_api_key(s, name="ops", role="admin", actor="test").token
        viewer = ledger.create_api_key(s, name="dash", role="viewer", actor="test").token
    return alice, admin, viewer
