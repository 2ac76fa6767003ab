"""Failed credentials: budgets per address and per credential, answered 429 past them, while a
credential that verifies is always served; sign-in is rate limited per address."""

from __future__ import annotations

from typing import TYPE_CHECKING

from api_world import sign_in
from fastapi.testclient import TestClient

from zoo_gym.coordinator.api.app import create_app
from zoo_gym.coordinator.api.limits import ApiGuard, credential_name
from zoo_gym.coordinator.config import CoordinatorConfig
from zoo_gym.coordinator.serve import api_services

if TYPE_CHECKING:
    from api_world import World


def guarded(
    world: World, *, max_failures: int = 3, lockout_s: float = 60.0, auth_burst: int = 4
) -> list[float]:
    """Give `world` a guard on a hand-driven clock; returns the clock to move."""
    now = [1000.0]
    world.app.state.zoo.guard = ApiGuard(
        auth_rate_per_s=1.0,
        auth_burst=auth_burst,
        max_failures=max_failures,
        lockout_s=lockout_s,
        clock=lambda: now[0],
    )
    return now


def from_address(world: World, host: str) -> TestClient:
    return TestClient(world.app, client=(host, 40000))


def test_past_the_budget_failures_get_429_and_the_right_key_still_gets_in(world: World) -> None:
    now = guarded(world)
    attacker = from_address(world, "203.0.113.7")
    bad = [attacker.get("/rounds", headers=world.auth(f"garbage-{i}")) for i in range(5)]

    admin_same_address = attacker.get("/rounds", headers=world.as_admin)
    now[0] += 20.0  # a budget of 3 per 60 s refills one failure every 20 s
    refilled = attacker.get("/rounds", headers=world.auth("garbage-again"))

    assert [r.status_code for r in bad] == [401, 401, 401, 429, 429]
    assert bad[3].headers["retry-after"] == "20"
    assert "retry in 20 s" in bad[3].json()["detail"]
    assert admin_same_address.status_code == 200
    assert refilled.status_code == 401


def test_failures_naming_one_key_from_many_addresses_hit_its_budget(world: World) -> None:
    guarded(world)
    prefix = world.admin.split("_")[1]
    guesses = [
        from_address(world, f"203.0.113.{i}").get(
            "/rounds", headers=world.auth(f"zgk_{prefix}_guess{i}")
        )
        for i in range(4)
    ]
    owner = from_address(world, "203.0.113.99").get("/rounds", headers=world.as_admin)
    other_key = from_address(world, "203.0.113.98").get(
        "/rounds", headers=world.auth("zgk_0badc0de_guess")
    )

    assert [r.status_code for r in guesses] == [401, 401, 401, 429]
    assert owner.status_code == 200  # the key's owner is never locked out
    assert other_key.status_code == 401  # another key, from a fresh address, has its own budget


def test_missing_credentials_count_like_bad_ones(world: World) -> None:
    guarded(world)
    client = from_address(world, "203.0.113.9")
    missing = [client.get("/rounds").status_code for _ in range(4)]
    assert missing == [401, 401, 401, 429]
    assert client.get("/rounds", headers=world.as_viewer).status_code == 200


def test_forged_contributor_tokens_and_bad_signatures_count_but_a_signature_gets_in(
    world: World,
) -> None:
    guarded(world, max_failures=2, auth_burst=10)
    client = from_address(world, "203.0.113.10")
    cid = world.alice.contributor_id
    forged = client.get(
        f"/contributors/{cid}", headers=world.auth(f"zgc_{cid}_99999999999999_{'0' * 64}")
    )
    challenge = client.post("/auth/challenge", json={"contributor_id": cid}).json()
    wrong = client.post(
        "/auth/token",
        json={"contributor_id": cid, "nonce": challenge["nonce"], "signature": "00" * 64},
    )
    spent = client.post(
        "/auth/token",
        json={"contributor_id": cid, "nonce": challenge["nonce"], "signature": "00" * 64},
    )
    token = sign_in(client, world.alice)
    own = client.get(f"/contributors/{cid}", headers=world.auth(token))

    assert forged.status_code == 401 and wrong.status_code == 401
    assert spent.status_code == 429 and spent.headers["retry-after"]
    assert own.status_code == 200


def test_sign_in_is_rate_limited_per_address(world: World) -> None:
    now = guarded(world)
    client = from_address(world, "203.0.113.11")
    body = {"contributor_id": world.alice.contributor_id}
    codes = [client.post("/auth/challenge", json=body).status_code for _ in range(5)]
    other = from_address(world, "203.0.113.12").post("/auth/challenge", json=body)
    now[0] += 1.0
    refilled = client.post("/auth/challenge", json=body)

    assert codes == [200, 200, 200, 200, 429]
    assert other.status_code == 200
    assert refilled.status_code == 200


def test_credential_names() -> None:
    cid = "ab" * 16
    assert credential_name("zgk_0123abcd_secret") == "apikey:0123abcd"
    assert credential_name(f"zgc_{cid}_1_mac") == f"contributor:{cid}"
    assert credential_name("zgk_NOTHEX00_secret") is None
    assert credential_name("zgc_short_1_mac") is None
    assert credential_name("garbage") is None


def test_guard_comes_from_the_configuration(world: World) -> None:
    c, defaults = world.co.config, CoordinatorConfig.model_validate({})
    assert (c.api_max_failures, c.api_lockout_s, c.api_auth_burst) == (10, 300.0, 20)
    assert c.api_max_body_bytes == defaults.api_max_body_bytes == 64 << 10

    guard = create_app(api_services(world.co)).state.zoo.guard
    assert (guard.max_failures, guard.lockout_s, guard.sign_in.burst) == (10, 300.0, 20.0)
    assert guard.address_failures.rate == guard.credential_failures.rate == 10 / 300.0
