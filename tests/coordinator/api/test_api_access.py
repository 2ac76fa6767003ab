"""Every route of the app refuses a missing or bad token (401) and the wrong role (403).

The routes are read from the app itself, so a route added without an access dependency fails
here (and `create_app` refuses to build).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, cast

import pytest
from api_world import sign_in
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

from zoo_gym.coordinator.api.app import OPEN_ROUTES, api_routes, create_app
from zoo_gym.coordinator.api.deps import ApiServices, route_access
from zoo_gym.coordinator.api.limits import ApiGuard
from zoo_gym.coordinator.config import CoordinatorConfig
from zoo_gym.coordinator.control import RoundControl
from zoo_gym.coordinator.liveness import LoopHealth
from zoo_gym.coordinator.metrics import CoordinatorMetrics
from zoo_gym.coordinator.serve import api_services

if TYPE_CHECKING:
    from api_world import World


def stand_in(config: CoordinatorConfig) -> ApiServices:
    """Services for building the app only: routes never touch them at build time."""
    return ApiServices(
        engine=cast(Any, None),
        settings=lambda: config,
        registry=cast(Any, None),
        checkpoints=cast(Any, None),
        rounds=cast(Any, None),
        control=RoundControl(),
        metrics=CoordinatorMetrics(),
        health=LoopHealth(),
    )


# the app's routes, built against stand-in services
APP = create_app(stand_in(CoordinatorConfig.model_validate({})), guard=ApiGuard())
ROUTES = [
    pytest.param(method, route, id=f"{method} {route.path}")
    for route in api_routes(APP)
    for method in sorted(route.methods or ())
]
PROTECTED = [p for p in ROUTES if (p.values[0], p.values[1].path) not in OPEN_ROUTES]
PARAMS: dict[str, dict[str, Any]] = {
    "/ledger/proofs/inclusion": {"index": 0},
    "/ledger/proofs/consistency": {"old_size": 1},
}


def url(route: APIRoute, world: World, *, contributor: str | None = None) -> str:
    values = {
        "number": "1",
        "contributor_id": contributor or world.bob.contributor_id,
        "version": "v0000",
        "name": "config.json",
        "prefix": "ffffffff",
    }
    return route.path.format(**values)


def call(world: World, method: str, route: APIRoute, headers: dict[str, str], **kw: Any) -> Any:
    body = {"aggregator": "median"} if method == "PATCH" else {"reason": "test"}
    return world.client.request(
        method,
        url(route, world, **kw),
        headers=headers,
        params=PARAMS.get(route.path),
        json=body if method in ("POST", "PATCH") else None,
    )


def test_only_health_and_sign_in_are_open() -> None:
    open_routes = {(p.values[0], p.values[1].path) for p in ROUTES if not route_access(p.values[1])}
    assert (
        open_routes
        == OPEN_ROUTES
        == {
            ("GET", "/health"),
            ("POST", "/auth/challenge"),
            ("POST", "/auth/token"),
        }
    )


def test_every_route_has_a_unique_operation_id() -> None:
    ids = [p.values[1].operation_id for p in ROUTES]
    assert all(ids) and len(ids) == len(set(ids))
    spec = APP.openapi()
    from_spec = [op["operationId"] for item in spec["paths"].values() for op in item.values()]
    described = [p.values[1].operation_id for p in ROUTES if p.values[1].include_in_schema]
    assert sorted(from_spec) == sorted(described)
    assert set(ids) - set(described) == {"openapi"}  # the description does not describe itself
    assert spec["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"


@pytest.mark.parametrize(("method", "route"), PROTECTED)
def test_route_refuses_a_missing_token(shared_world: World, method: str, route: APIRoute) -> None:
    shared_world.app.state.zoo.guard = ApiGuard()  # each case fresh: a missing token counts too
    response = call(shared_world, method, route, {})
    assert response.status_code == 401, response.text
    assert response.headers["www-authenticate"] == "Bearer"


@pytest.mark.parametrize(("method", "route"), PROTECTED)
@pytest.mark.parametrize(
    "token",
    ["zgk_00000000_not-a-key", "garbage", "zgc_" + "0" * 32 + "_99999999999999_" + "0" * 64],
    ids=["unknown-key", "garbage", "forged-contributor-token"],
)
def test_route_refuses_a_bad_token(
    shared_world: World, method: str, route: APIRoute, token: str
) -> None:
    shared_world.app.state.zoo.guard = (
        ApiGuard()
    )  # each case fresh: a bad token counts to a lockout
    response = call(shared_world, method, route, shared_world.auth(token))
    assert response.status_code == 401, response.text
    assert response.headers["www-authenticate"] == "Bearer"


@pytest.fixture(scope="module")
def alice_token(shared_world: World) -> str:
    return sign_in(shared_world.client, shared_world.alice)


@pytest.mark.parametrize(("method", "route"), PROTECTED)
def test_route_refuses_the_wrong_role(
    shared_world: World, alice_token: str, method: str, route: APIRoute
) -> None:
    (access,) = route_access(route)
    w = shared_world
    if access == "admin":
        response = call(w, method, route, w.as_viewer)
    elif access in ("viewer", "self"):  # alice's token; `self` routes name bob in the path
        response = call(w, method, route, w.auth(alice_token))
    else:  # "reader": every principal may call it
        assert access == "reader"
        response = call(w, method, route, w.auth(alice_token))
        assert response.status_code not in (401, 403), response.text
        return
    assert response.status_code == 403, response.text


def test_contributor_reads_own_records(shared_world: World, alice_token: str) -> None:
    w, cid = shared_world, shared_world.alice.contributor_id
    for path in ("", "/submissions", "/rewards", "/report"):
        response = w.client.get(f"/contributors/{cid}{path}", headers=w.auth(alice_token))
        assert response.status_code == 200, (path, response.text)


def test_schema_needs_a_viewer_key_and_docs_are_off(shared_world: World, alice_token: str) -> None:
    w = shared_world
    anonymous = w.client.get("/openapi.json")
    contributor = w.client.get("/openapi.json", headers=w.auth(alice_token))
    viewer = w.client.get("/openapi.json", headers=w.as_viewer)

    assert anonymous.status_code == 401 and contributor.status_code == 403
    assert "/rounds/{number}/abort" in viewer.json()["paths"]
    assert "/openapi.json" not in viewer.json()["paths"]
    assert w.client.get("/docs").status_code == 404
    assert w.client.get("/redoc").status_code == 404


def test_api_docs_setting_serves_docs_and_an_open_schema(world: World) -> None:
    config = world.co.config.model_copy(update={"api_docs": True})
    services = replace(api_services(world.co), settings=lambda: config)
    client = TestClient(create_app(services))

    assert client.get("/docs").status_code == 200
    assert client.get("/redoc").status_code == 200
    assert "/rounds/{number}/abort" in client.get("/openapi.json").json()["paths"]
