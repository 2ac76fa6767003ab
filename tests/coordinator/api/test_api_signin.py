"""Contributors sign in by signing a nonce challenge; the token reaches only their own records."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import pytest

from zoo_gym.coordinator.api.auth import challenge_statement
from zoo_gym.core.identity import Identity

if TYPE_CHECKING:
    from api_world import World

from api_world import sign_in


def answer(
    world: World, cid: str, signer: Identity, *, challenge: dict[str, Any] | None = None
) -> Any:
    challenge = (
        challenge or world.client.post("/auth/challenge", json={"contributor_id": cid}).json()
    )
    statement = challenge_statement(cid, challenge["nonce"], challenge["expires_at_ms"])
    body = {
        "contributor_id": cid,
        "nonce": challenge["nonce"],
        "signature": signer.sign(statement).hex(),
    }
    return world.client.post("/auth/token", json=body)


def test_signed_challenge_gives_a_token_for_own_records_only(world: World) -> None:
    # Execute
    token = sign_in(world.client, world.alice)
    own = world.client.get(
        f"/contributors/{world.alice.contributor_id}/report", headers=world.auth(token)
    )
    other = world.client.get(
        f"/contributors/{world.bob.contributor_id}/report", headers=world.auth(token)
    )
    listing = world.client.get("/contributors", headers=world.auth(token))

    # Assert
    assert token.startswith("zgc_")
    assert own.status_code == 200 and own.json()["totals"]["reward"] == 5.0
    assert other.status_code == 403 and "another contributor" in other.json()["detail"]
    assert listing.status_code == 403


def test_signature_with_another_key_is_refused(world: World) -> None:
    response = answer(world, world.alice.contributor_id, world.bob)
    assert response.status_code == 401 and "registered key" in response.json()["detail"]
    assert response.headers["www-authenticate"] == "Bearer"


def test_challenge_is_single_use(world: World) -> None:
    cid = world.alice.contributor_id
    challenge = world.client.post("/auth/challenge", json={"contributor_id": cid}).json()
    assert answer(world, cid, world.alice, challenge=challenge).status_code == 200
    replay = answer(world, cid, world.alice, challenge=challenge)
    assert replay.status_code == 401 and "unknown, used or expired" in replay.json()["detail"]


def test_expired_challenge_and_token_are_refused(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare
    auth = world.app.state.zoo.auth
    cid = world.alice.contributor_id
    token = sign_in(world.client, world.alice)
    challenge = world.client.post("/auth/challenge", json={"contributor_id": cid}).json()

    # Execute: an hour later
    monkeypatch.setattr(auth, "clock", lambda: time.time() + 3600)
    late = answer(world, cid, world.alice, challenge=challenge)
    expired = world.client.get(f"/contributors/{cid}/report", headers=world.auth(token))

    # Assert
    assert late.status_code == 401
    assert expired.status_code == 401 and "expired" in expired.json()["detail"]


def test_unregistered_or_malformed_contributor(world: World) -> None:
    stranger = Identity.generate()
    assert answer(world, stranger.contributor_id, stranger).status_code == 401
    malformed = world.client.post("/auth/challenge", json={"contributor_id": "../etc"})
    assert malformed.status_code == 422


def test_tampered_token_is_refused(world: World) -> None:
    token = sign_in(world.client, world.alice)
    prefix, _, expires, mac = token.split("_")
    forged = "_".join([prefix, world.bob.contributor_id, expires, mac])
    response = world.client.get(
        f"/contributors/{world.bob.contributor_id}", headers=world.auth(forged)
    )
    assert response.status_code == 401


def test_revoked_api_key_is_refused(world: World) -> None:
    from zoo_gym import ledger

    assert world.client.get("/rounds", headers=world.as_viewer).status_code == 200
    with world.session() as s:
        ledger.revoke_api_key(s, key="grafana", actor="test")
    response = world.client.get("/rounds", headers=world.as_viewer)
    assert response.status_code == 401 and "revoked" in response.json()["detail"]
