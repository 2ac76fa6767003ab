"""The admin API against its own OpenAPI spec, with schemathesis (property-based, over ASGI).

The app runs with the configuration's DEFAULT limits (body size, failure budgets, sign-in rate):
the keyed runs are never refused, since a credential that verifies is always served.
Every operation of `/openapi.json` (fetched with a viewer key) is called with generated inputs
three ways:
- without credentials: every protected operation answers 401 (open ones answer, never 5xx);
- with a viewer key and with an admin key: never 5xx, and every response that the spec describes
  conforms to its schema.

The default suite draws `ZOO_SCHEMA_EXAMPLES` cases per operation (default 5); the slow variant
(`pytest -m slow tests/coordinator/api/test_schemathesis.py`) draws 50.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import unquote

import pytest
import schemathesis
from api_world import World
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance

from zoo_gym.coordinator.api.app import OPEN_ROUTES, make_guard
from zoo_gym.coordinator.api.limits import CONTROL_CHARACTER, RequestLimits
from zoo_gym.coordinator.config import CoordinatorConfig

EXAMPLES = int(os.environ.get("ZOO_SCHEMA_EXAMPLES", "5"))
CASES: Counter[str] = Counter()


@pytest.fixture(scope="module")
def api_world(shared_world: World) -> Iterator[World]:
    yield shared_world
    print("\nschemathesis cases:", dict(CASES), "total", sum(CASES.values()))


@pytest.fixture(scope="module")
def api_schema(api_world: World) -> Any:
    return schemathesis.openapi.from_asgi(
        "/openapi.json", api_world.app, headers=api_world.as_viewer
    )


FAST = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
SLOW = settings(max_examples=50, deadline=None, suppress_health_check=list(HealthCheck))


def is_open(case: Any) -> bool:
    return (case.method.upper(), case.operation.path) in OPEN_ROUTES


def malformed(case: Any) -> bool:
    """A path parameter holds a control character: the path is refused before routing."""
    values = (case.path_parameters or {}).values()
    return any(CONTROL_CHARACTER.search(unquote(str(v))) for v in values)


def anonymous(world: World) -> Callable[[Any], None]:
    """The check for calls without credentials; each case comes from a fresh address (a missing
    token counts against its address's failure budget, as a bad one does)."""

    def check(case: Any) -> None:
        world.app.state.zoo.guard = make_guard(world.co.config)
        without_credentials(case)

    return check


def without_credentials(case: Any) -> None:
    CASES["anonymous"] += 1
    case.headers = {k: v for k, v in (case.headers or {}).items() if k.lower() != "authorization"}
    response = case.call()
    assert response.status_code < 500, response.text
    if not is_open(case):
        expected = 404 if malformed(case) else 401  # no route has such a path
        assert response.status_code == expected, (
            f"{case.method} {case.path}: {response.status_code}"
        )


def with_key(token: str, role: str) -> Callable[[Any], None]:
    def check(case: Any) -> None:
        CASES[role] += 1
        case.call_and_validate(
            headers={"Authorization": f"Bearer {token}"},
            checks=[not_a_server_error, response_schema_conformance],
        )

    return check


def every_operation(api_schema: Any, check: Callable[[Any], None], config: settings) -> int:
    """Run `check` on generated cases of every operation; returns how many operations ran."""
    operations = [result.ok() for result in api_schema.get_all_operations()]
    for operation in operations:

        @config
        @given(case=operation.as_strategy())
        def run(case: Any) -> None:
            check(case)

        try:
            run()
        except Exception as exc:
            raise AssertionError(f"{operation.method.upper()} {operation.path}: {exc}") from exc
    return len(operations)


def test_runs_with_default_limits(api_world: World) -> None:
    defaults = CoordinatorConfig.model_validate({})
    guard = api_world.app.state.zoo.guard
    assert api_world.co.config.model_dump() == {
        **defaults.model_dump(),
        **{k: getattr(api_world.co.config, k) for k in ("home", "listen", "rest_listen")},
    }
    assert (guard.max_failures, guard.lockout_s) == (
        defaults.api_max_failures,
        defaults.api_lockout_s,
    )
    assert guard.sign_in.rate == defaults.api_auth_rate_per_s > 0
    limits = [m for m in api_world.app.user_middleware if m.cls is RequestLimits]
    assert [m.kwargs["max_body_bytes"] for m in limits] == [defaults.api_max_body_bytes]


def test_without_credentials(api_schema: Any, api_world: World) -> None:
    assert every_operation(api_schema, anonymous(api_world), FAST) >= 30


def test_with_viewer_key(api_schema: Any, api_world: World) -> None:
    every_operation(api_schema, with_key(api_world.viewer, "viewer"), FAST)


def test_with_admin_key(api_schema: Any, api_world: World) -> None:
    every_operation(api_schema, with_key(api_world.admin, "admin"), FAST)


@pytest.mark.slow
def test_many_examples(api_schema: Any, api_world: World) -> None:
    every_operation(api_schema, anonymous(api_world), SLOW)
    every_operation(api_schema, with_key(api_world.viewer, "viewer (slow)"), SLOW)
    every_operation(api_schema, with_key(api_world.admin, "admin (slow)"), SLOW)
