"""Past a spent failure budget, requests without a valid credential are answered after the
default `api_refusal_delay_s` and never reach the app; valid credentials are not slowed."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import pytest
from api_world import sign_in
from fastapi.testclient import TestClient

from zoo_gym import ledger
from zoo_gym.coordinator.config import CoordinatorConfig

if TYPE_CHECKING:
    from api_world import World

DELAY_S = CoordinatorConfig.model_validate({}).api_refusal_delay_s
ATTACKER = "198.51.100.7"


def spent(world: World, host: str = ATTACKER) -> TestClient:
    """A client at `host` whose address has used its whole failure budget."""
    client = TestClient(world.app, client=(host, 40000))
    guard = world.app.state.zoo.guard
    for _ in range(guard.max_failures):
        guard.failed(host, None)
    assert guard.spent(host, None)
    return client


def timed(client: TestClient, token: str | None, world: World) -> tuple[int, float]:
    headers = world.auth(token) if token is not None else {}
    began = time.perf_counter()
    response = client.get("/rounds", headers=headers)
    return response.status_code, time.perf_counter() - began


@pytest.fixture
def lookups(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every API key the app itself looked up in the ledger (its prefix)."""
    seen: list[str] = []
    real = ledger.authenticate_api_key

    def spy(session: object, *, token: str) -> object:
        seen.append(token.split("_")[1] if token.count("_") >= 2 else token)
        return real(session, token=token)  # type: ignore[arg-type]

    monkeypatch.setattr(ledger, "authenticate_api_key", spy)
    return seen


def test_default_delay_is_one_second() -> None:
    assert DELAY_S == 1.0


def test_bad_tokens_past_the_budget_wait_and_never_reach_the_app(
    world: World, lookups: list[str]
) -> None:
    client = spent(world)
    answers = [timed(client, token, world) for token in ("zgk_0badc0de_guess", "garbage", None)]

    assert [status for status, _ in answers] == [429, 429, 429]
    assert all(took >= 0.9 * DELAY_S for _, took in answers), answers
    assert lookups == []  # the app's key lookup never ran
    response = client.get("/rounds", headers=world.auth("garbage"))
    assert int(response.headers["retry-after"]) >= 1
    assert "a valid credential is always served" in response.json()["detail"]


def test_valid_credentials_from_a_spent_address_are_served_at_once(world: World) -> None:
    client = spent(world)
    token = sign_in(TestClient(world.app), world.alice)
    key_status, key_took = timed(client, world.admin, world)
    contributor = client.get(
        f"/contributors/{world.alice.contributor_id}", headers=world.auth(token)
    )

    assert key_status == 200 and key_took < DELAY_S
    assert contributor.status_code == 200


def test_a_key_issued_a_moment_ago_is_served_after_one_delay(world: World) -> None:
    client = spent(world)
    assert timed(client, world.viewer, world)[0] == 200  # the key table is read now
    with world.session() as session:
        fresh = ledger.create_api_key(session, name="new operator", role="viewer", actor="test")

    status, took = timed(client, fresh.token, world)

    assert status == 200
    assert took >= 0.9 * DELAY_S  # it waited for the table to be read again


def test_a_revoked_key_is_refused_after_the_delay(world: World) -> None:
    with world.session() as session:
        issued = ledger.create_api_key(session, name="leaving", role="viewer", actor="test")
        ledger.revoke_api_key(session, key=issued.key.prefix, actor="test")
    client = spent(world)

    assert timed(client, issued.token, world)[0] == 429


def test_a_fresh_address_is_not_paced(world: World) -> None:
    spent(world)
    status, took = timed(TestClient(world.app, client=("198.51.100.8", 1)), "garbage", world)
    assert status == 401 and took < DELAY_S
