"""A real coordinator (tiny home, SQLite ledger) behind its REST app, with a few ledger rows.

Helpers live here, not in conftest.py, so that test modules can import them by a unique name.

`World` holds the app's TestClient, an admin and a viewer key, and two registered contributors
(alice, bob): round 1 is published with alice's update accepted and rewarded and bob's rejected.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlmodel import Session

from zoo_gym import ledger
from zoo_gym.coordinator.api.app import create_app
from zoo_gym.coordinator.api.auth import challenge_statement
from zoo_gym.coordinator.config import load_config
from zoo_gym.coordinator.control import RoundControl
from zoo_gym.coordinator.metrics import CoordinatorMetrics
from zoo_gym.coordinator.serve import api_services
from zoo_gym.coordinator.service import Coordinator
from zoo_gym.core.identity import Identity


@dataclass
class World:
    co: Coordinator
    app: FastAPI
    client: TestClient
    control: RoundControl
    metrics: CoordinatorMetrics
    admin: str
    viewer: str
    alice: Identity
    bob: Identity
    accepted_id: int
    rejected_id: int

    def auth(self, token: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {token}"}

    @property
    def as_admin(self) -> dict[str, str]:
        return self.auth(self.admin)

    @property
    def as_viewer(self) -> dict[str, str]:
        return self.auth(self.viewer)

    def session(self) -> Session:
        return Session(self.co.engine)


def sign_in(client: TestClient, identity: Identity) -> str:
    """A contributor token by the challenge flow."""
    cid = identity.contributor_id
    challenge = client.post("/auth/challenge", json={"contributor_id": cid}).json()
    statement = challenge_statement(cid, challenge["nonce"], challenge["expires_at_ms"])
    answer = {
        "contributor_id": cid,
        "nonce": challenge["nonce"],
        "signature": identity.sign(statement).hex(),
    }
    response = client.post("/auth/token", json=answer)
    assert response.status_code == 200, response.text
    token: str = response.json()["access_token"]
    return token


def build_world(home: Path) -> World:
    co = Coordinator(load_config(home / "coordinator.toml"))
    alice, bob = Identity.generate(), Identity.generate()
    with Session(co.engine) as s:
        for who, name in ((alice, "alice"), (bob, "bob")):
            ledger.register_contributor(
                s, contributor_id=who.contributor_id, public_key=who.public_key, name=name
            )
        ledger.open_round(
            s, number=1, base_version="v0000", seed=1, aggregator="fedavg", codec="bitdelta"
        )
        accepted = ledger.record_submission(
            s,
            round_number=1,
            contributor_id=alice.contributor_id,
            nonce="a1",
            base_version="v0000",
            payload_sha256="aa" * 32,
            size_bytes=100,
            decision="accepted",
            reason="accepted at intake",
        )
        rejected = ledger.record_submission(
            s,
            round_number=1,
            contributor_id=bob.contributor_id,
            nonce="b1",
            base_version="v0000",
            payload_sha256="bb" * 32,
            size_bytes=100,
            decision="rejected",
            reason="update envelope is invalid: bad magic",
        )
        accepted_id, rejected_id = accepted.id, rejected.id
        assert accepted_id is not None and rejected_id is not None
        ledger.record_aggregation(
            s,
            submission_id=accepted_id,
            selected=True,
            weight=1.0,
            trimmed_share=0.0,
            score=0.5,
            reason="fedavg: averaged",
        )
        ledger.record_reward(
            s,
            round_number=1,
            contributor_id=alice.contributor_id,
            quality=0.25,
            amount=5.0,
            reputation_after=0.25,
        )
        ledger.close_round(
            s, number=1, status="published", new_version=None, metrics={"accepted": 1}
        )
        admin = ledger.create_api_key(s, name="ops", role="admin", actor="test").token
        viewer = ledger.create_api_key(s, name="grafana", role="viewer", actor="test").token
    app = create_app(api_services(co))
    return World(
        co,
        app,
        TestClient(app),
        co.control,
        co.metrics,
        admin,
        viewer,
        alice,
        bob,
        accepted_id,
        rejected_id,
    )
