"""REST app for operators (FastAPI): `create_app` composes the routers, `RestServer` serves them.

Every route needs a bearer token except `/health` and contributor sign-in (`/auth/challenge`,
`/auth/token`). `/openapi.json` needs a viewer key (`gym-coordinator admin openapi` fetches it);
`/docs` and `/redoc` are off unless `api_docs` is set, which also opens `/openapi.json`.
`/metrics` needs a viewer key (Prometheus: `authorization: {type: Bearer, credentials_file: ...}`
in the scrape config). Each route's OpenAPI description ends with the access it needs.

Requests are bounded before parsing and error bodies never repeat the input (`limits`): a
validation error names the field and the rule, and an unexpected error says only that it
happened (its traceback goes to the coordinator's log).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import fastapi.routing
import uvicorn
from fastapi import FastAPI, Request, status
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException

from zoo_gym import ledger
from zoo_gym.coordinator.api.auth import ContributorAuth
from zoo_gym.coordinator.api.deps import (
    ACCESS_TEXT,
    ApiServices,
    ApiState,
    ViewerDep,
    route_access,
)
from zoo_gym.coordinator.api.limits import ApiGuard, RequestLimits, short
from zoo_gym.coordinator.api.pacing import FailurePacing, KeyTable
from zoo_gym.coordinator.api.routes import auth, contributors, models, policy, rewards, rounds
from zoo_gym.coordinator.api.routes import ledger as ledger_routes
from zoo_gym.coordinator.api.routes import metrics as metrics_routes
from zoo_gym.coordinator.config import CoordinatorConfig
from zoo_gym.coordinator.control import PolicyError
from zoo_gym.ledger import Session
from zoo_gym.transport.heads import guarded_h11

OPEN_ROUTES: frozenset[tuple[str, str]] = frozenset(
    {("GET", "/health"), ("POST", "/auth/challenge"), ("POST", "/auth/token")}
)
"""(method, path) of the routes that need no token."""


ROUTERS = (auth, rounds, contributors, policy, models, ledger_routes, rewards, metrics_routes)
MAX_ERRORS = 10
MAX_LOC_CHARS = 64


def _error(status_code: int) -> Any:
    def handler(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse({"detail": short(str(exc))}, status_code=status_code)

    return handler


def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's answer to an HTTPException (FastAPI's too), with the detail cut short."""
    assert isinstance(exc, HTTPException)
    if exc.status_code in (204, 304):
        return Response(status_code=exc.status_code, headers=exc.headers)
    detail = short(exc.detail) if isinstance(exc.detail, str) else exc.detail
    return JSONResponse({"detail": detail}, status_code=exc.status_code, headers=exc.headers)


def _location(part: Any) -> str | int:
    return part if isinstance(part, int) else short(str(part), MAX_LOC_CHARS)


def _invalid(request: Request, exc: Exception) -> JSONResponse:
    """422 naming each wrong field and the rule it broke, never the value sent (nor `ctx`)."""
    assert isinstance(exc, RequestValidationError)
    errors = [
        {
            "loc": [_location(p) for p in e.get("loc", ())][:8],
            "msg": short(str(e.get("msg", ""))),
            "type": short(str(e.get("type", "")), MAX_LOC_CHARS),
        }
        for e in exc.errors()[:MAX_ERRORS]
    ]
    return JSONResponse({"detail": errors}, status_code=status.HTTP_422_UNPROCESSABLE_CONTENT)


def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    """500 without the traceback (the server logs it when the exception leaves the app)."""
    return JSONResponse(
        {"detail": "the coordinator failed on this request; its log has the details"},
        status_code=status.HTTP_500_INTERNAL_SERVER_ERROR,
    )


def api_routes(app: FastAPI) -> list[APIRoute]:
    """Every API route `app` serves, with its full path.

    FastAPI 0.138 keeps an included router as one entry of `app.routes` (walked with
    `iter_route_contexts`); earlier versions copy its routes into `app.routes`.
    """
    iter_contexts = getattr(fastapi.routing, "iter_route_contexts", None)
    if iter_contexts is None:
        return [r for r in app.routes if isinstance(r, APIRoute)]
    originals = (c.original_route for c in iter_contexts(app.routes))
    return [r for r in originals if isinstance(r, APIRoute)]


def _document_access(app: FastAPI) -> None:
    """End each route's description with the access it needs; refuse a route that states none."""
    for route in api_routes(app):
        found = route_access(route)
        opened = {(m, route.path) for m in route.methods or ()} <= OPEN_ROUTES
        if opened == bool(found) or len(found) > 1:
            raise RuntimeError(
                f"{route.path}: declare exactly one access dependency or list it open"
            )
        note = f"Access: {ACCESS_TEXT['open' if opened else next(iter(found))]}."
        if not route.description.endswith(note):  # routers are shared by every app built
            route.description = f"{route.description}\n\n{note}".strip()


def make_guard(c: CoordinatorConfig) -> ApiGuard:
    return ApiGuard(
        auth_rate_per_s=c.api_auth_rate_per_s,
        auth_burst=c.api_auth_burst,
        max_failures=c.api_max_failures,
        lockout_s=c.api_lockout_s,
        refusal_delay_s=c.api_refusal_delay_s,
    )


def _handle_errors(app: FastAPI) -> None:
    app.add_exception_handler(ledger.NotFound, _error(status.HTTP_404_NOT_FOUND))
    app.add_exception_handler(ledger.LedgerError, _error(status.HTTP_409_CONFLICT))
    app.add_exception_handler(PolicyError, _error(400))  # 422 is FastAPI's validation body
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(Exception, _unexpected)


def _serve_schema(app: FastAPI) -> None:
    """`/openapi.json` for viewers (with `api_docs`, FastAPI serves it open beside the docs)."""

    @app.get("/openapi.json", operation_id="openapi", include_in_schema=False)
    def openapi(viewer: ViewerDep) -> dict[str, Any]:
        """This API's OpenAPI description."""
        return app.openapi()


def _fastapi(*, docs: bool) -> FastAPI:
    """The app; `/docs`, `/redoc` and an open `/openapi.json` only with `docs`."""
    return FastAPI(
        title="zoo-gym coordinator",
        version="1",
        description="Operators' API: rounds, contributors, policy, models, ledger, rewards.",
        openapi_url="/openapi.json" if docs else None,
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
    )


def _guard_requests(app: FastAPI, state: ApiState) -> None:
    """The viewer-only schema (unless docs are on), the error handlers, the pacing of failed
    credentials and, around everything, the request limits."""
    services, config = state.services, state.services.settings()
    if not config.api_docs:
        _serve_schema(app)
    _handle_errors(app)

    def load_keys() -> dict[str, str]:
        with Session(services.engine) as session:
            return ledger.active_key_digests(session)

    app.add_middleware(
        FailurePacing,
        keys=KeyTable(load_keys),
        open_routes=OPEN_ROUTES,
    )
    app.add_middleware(
        RequestLimits,
        max_body_bytes=config.api_max_body_bytes,
        read_timeout_s=config.api_read_timeout_s,
    )


def create_app(
    services: ApiServices,
    *,
    contributor_auth: ContributorAuth | None = None,
    guard: ApiGuard | None = None,
) -> FastAPI:
    """The REST API over `services` (`serve.api_services` builds them from a coordinator)."""
    config = services.settings()
    app = _fastapi(docs=config.api_docs)
    state = ApiState(
        services,
        auth=contributor_auth if contributor_auth is not None else ContributorAuth(),
        guard=guard if guard is not None else make_guard(config),
    )
    services.metrics.watch_ledger(services.engine)
    services.metrics.watch_control(services.control)
    services.metrics.watch_loop(services.health)
    app.state.zoo = state

    @app.get(
        "/health",
        operation_id="health",
        tags=["health"],
        responses={503: {"description": "the round loop stopped or crashed, or serve is stopping"}},
    )
    def health_route(response: Response) -> dict[str, Any]:
        """`status` "ok" while rounds run or wait (also while paused); otherwise a 503 whose
        `reason` says why the round loop ended."""
        loop = services.health.status()
        if not loop.healthy:
            response.status_code = status.HTTP_503_SERVICE_UNAVAILABLE
        current = services.rounds.open_round
        return {
            "status": "ok" if loop.healthy else "unavailable",
            "round_loop": loop.state,
            "reason": loop.reason,
            "paused": services.control.paused,
            "open_round": current.number if current else None,
            "model_version": services.rounds.current_version(),
        }

    for module in ROUTERS:
        app.include_router(module.router)
    _guard_requests(app, state)
    _document_access(app)
    return app


class RestServer:
    """Uvicorn in a background thread."""

    def __init__(self, services: ApiServices, listen: str) -> None:
        host, port = listen.rsplit(":", 1)
        settings = services.settings()
        self.app = create_app(services)
        config = uvicorn.Config(
            self.app,
            host=host,
            port=int(port),
            log_level="warning",
            # h11 bounds the request line and headers (httptools does not), within a deadline,
            # and connections per address
            http=guarded_h11(settings.api_read_timeout_s, settings.api_max_connections_per_address),
            h11_max_incomplete_event_size=settings.api_max_header_bytes,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="rest", daemon=True)

    def start(self, *, wait_s: float = 0.0) -> None:
        """Start serving; with `wait_s`, block until it listens (RuntimeError after that long)."""
        self.thread.start()
        deadline = time.monotonic() + wait_s
        while wait_s and not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the REST server did not start; is its port taken?")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=5)
