"""Brute-force resistance: bad credentials lock out their address, sign-in is rate limited."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi.testclient import TestClient

from zoo_gym.coordinator.api.limits import ApiGuard

if TYPE_CHECKING:
    from api_world import World


def guarded(world: World, *, max_failures: int = 3, lockout_s: float = 60.0) -> list[float]:
    """Give `world` a guard on a hand-driven clock; returns the clock to move."""
    now = [1000.0]
    world.app.state.zoo.guard = ApiGuard(
        auth_rate_per_s=1.0,
        auth_burst=4,
        max_failures=max_failures,
        lockout_s=lockout_s,
        clock=lambda: now[0],
    )
    return now


def from_address(world: World, host: str) -> TestClient:
    return TestClient(world.app, client=(host, 40000))


def test_after_n_bad_keys_even_the_right_key_waits_out_the_lockout(world: World) -> None:
    now = guarded(world)
    attacker = from_address(world, "203.0.113.7")
    bad = [attacker.get("/rounds", headers=world.auth(f"zgk_0000000{i}_guess")) for i in range(3)]

    locked = attacker.get("/rounds", headers=world.as_admin)
    bystander = from_address(world, "198.51.100.2").get("/rounds", headers=world.as_admin)
    now[0] += 61.0
    after = attacker.get("/rounds", headers=world.as_admin)

    assert [r.status_code for r in bad] == [401, 401, 401]
    assert locked.status_code == 429
    assert "locked out for 60 s more" in locked.json()["detail"]
    assert locked.headers["retry-after"] == "60"
    assert bystander.status_code == 200  # other addresses are not affected
    assert after.status_code == 200


def test_failures_spread_beyond_the_window_do_not_lock(world: World) -> None:
    now = guarded(world)
    client = from_address(world, "203.0.113.8")
    for _ in range(2):
        assert client.get("/rounds", headers=world.auth("garbage")).status_code == 401
    now[0] += 61.0  # the first two fell out of the window
    assert client.get("/rounds", headers=world.auth("garbage")).status_code == 401
    assert client.get("/rounds", headers=world.as_admin).status_code == 200


def test_missing_credentials_do_not_count(world: World) -> None:
    guarded(world)
    client = from_address(world, "203.0.113.9")
    assert all(client.get("/rounds").status_code == 401 for _ in range(5))
    assert client.get("/rounds", headers=world.as_admin).status_code == 200


def test_forged_contributor_tokens_and_bad_signatures_count(world: World) -> None:
    guarded(world, max_failures=2)
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
    refused = client.post("/auth/challenge", json={"contributor_id": cid})

    assert forged.status_code == 401 and wrong.status_code == 401
    assert refused.status_code == 429 and "locked out" in refused.json()["detail"]


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


def test_guard_comes_from_the_configuration(world: World) -> None:
    c = world.co.config
    assert (c.api_max_failures, c.api_lockout_s, c.api_auth_burst) == (10, 300.0, 20)
    from zoo_gym.coordinator.api.app import create_app

    guard = create_app(world.co).state.zoo.guard
    assert (guard.max_failures, guard.lockout_s, guard.sign_in.burst) == (10, 300.0, 20.0)
