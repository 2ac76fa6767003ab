"""Dependencies of the REST routes: the coordinator's services, a ledger session, and who is calling.

The API reaches the coordinator only through `ApiServices`: the ledger's engine, the policy in
force, the model registry, checkpoint signing, the open round, the operators' round control,
metrics and the round loop's health. Each is a small service or a protocol it satisfies.

Roles, from most to least power:

- ``admin``  (API key): everything, including every change;
- ``viewer`` (API key): every read;
- ``contributor`` (token from ``POST /auth/token``): its own contributor record, submissions,
  rewards and report, the latest checkpoint and ledger proofs.

No or a bad token is answered 401 with ``WWW-Authenticate: Bearer`` (a bad one past its failure
budgets 429, see `limits`; a valid one is never refused for others' failures); a valid token
without the role a route needs is answered 403. Each route states its access with exactly one of `AdminDep`,
`ViewerDep`, `SelfDep` (a viewer, or the contributor named in the path) or `ReaderDep` (anyone
authenticated); `route_access` reads that back, for the OpenAPI description and for the tests.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Protocol

from fastapi import Depends, HTTPException, Query, Request, status
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from zoo_gym import ledger
from zoo_gym.coordinator.api.auth import TOKEN_SCHEME, ContributorAuth
from zoo_gym.coordinator.api.limits import (
    ApiGuard,
    client_address,
    credential_name,
    refuse_credential,
)
from zoo_gym.coordinator.config import CoordinatorConfig
from zoo_gym.coordinator.control import RoundControl
from zoo_gym.coordinator.intake import OpenRound
from zoo_gym.coordinator.liveness import LoopHealth
from zoo_gym.coordinator.metrics import CoordinatorMetrics
from zoo_gym.coordinator.registry import ModelRegistry
from zoo_gym.ledger import Engine, Session
from zoo_gym.ledger.models import MAX_INT64

Role = Literal["admin", "viewer", "contributor"]


class Checkpoints(Protocol):
    """Signs the ledger's tree head as the coordinator (`POST /ledger/checkpoints`)."""

    @property
    def public_key(self) -> bytes: ...

    def sign_checkpoint(self, session: Session) -> ledger.Checkpoint: ...


class RoundView(Protocol):
    """The round intake is accepting now, and the version rounds start from (`/health`)."""

    @property
    def open_round(self) -> OpenRound | None: ...

    def current_version(self) -> str: ...


@dataclass(frozen=True)
class ApiServices:
    """What the API reaches of the coordinator."""

    engine: Engine
    settings: Callable[[], CoordinatorConfig]
    """The policy in force (a change staged through the API takes effect between rounds)."""
    registry: ModelRegistry
    checkpoints: Checkpoints
    rounds: RoundView
    control: RoundControl
    metrics: CoordinatorMetrics
    health: LoopHealth


@dataclass
class ApiState:
    """What every route may reach: the coordinator's services and the API's own state."""

    services: ApiServices
    auth: ContributorAuth
    guard: ApiGuard


@dataclass(frozen=True)
class Principal:
    """Who made a request: an operator's API key or a contributor's token."""

    role: Role
    name: str
    key_prefix: str | None = None
    contributor_id: str | None = None

    @property
    def actor(self) -> str:
        """How the ledger's audit events name this caller."""
        if self.contributor_id is not None:
            return f"contributor:{self.contributor_id}"
        return f"apikey:{self.name}/{self.key_prefix}"


def get_state(request: Request) -> ApiState:
    state: ApiState = request.app.state.zoo
    return state


StateDep = Annotated[ApiState, Depends(get_state)]


def get_session(state: StateDep) -> Iterator[Session]:
    with Session(state.services.engine) as session:
        yield session


SessionDep = Annotated[Session, Depends(get_session)]

# `?round=N` filters; bounded like the ledger's integer columns, so a larger N is a 422, not a 500
RoundQuery = Annotated[
    int | None, Query(alias="round", ge=0, le=MAX_INT64, description="only this round")
]

bearer = HTTPBearer(
    auto_error=False,
    description="An API key (`gym-coordinator apikey create`) or a contributor token (`POST /auth/token`).",
)


def unauthorized(detail: str) -> HTTPException:
    return HTTPException(
        status.HTTP_401_UNAUTHORIZED, detail=detail, headers={"WWW-Authenticate": "Bearer"}
    )


def forbidden(detail: str) -> HTTPException:
    return HTTPException(status.HTTP_403_FORBIDDEN, detail=detail)


def authenticate(
    request: Request,
    state: StateDep,
    session: SessionDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
) -> Principal:
    """Who is calling. A credential that verifies is always served; one that does not counts
    against its address and what it names, and past their budgets is answered 429 (`limits`)."""
    address = client_address(request)
    if credentials is None:
        missing = unauthorized(
            "this route needs a bearer token: an API key (gym-coordinator apikey create) "
            "or a contributor token (POST /auth/token)"
        )
        raise refuse_credential(state.guard, address, None, missing)
    token = credentials.credentials
    if token.startswith(f"{TOKEN_SCHEME}_"):
        contributor = state.auth.verify_token(token)
        if contributor is not None:
            return Principal("contributor", contributor, contributor_id=contributor)
        refusal = unauthorized("the contributor token is invalid or expired; sign in again")
    else:
        key = ledger.authenticate_api_key(session, token=token)
        if key is not None:
            role: Role = "admin" if key.role == "admin" else "viewer"
            return Principal(role, key.name, key_prefix=key.prefix)
        refusal = unauthorized("the API key is unknown or revoked")
    raise refuse_credential(state.guard, address, credential_name(token), refusal)


PrincipalDep = Annotated[Principal, Depends(authenticate)]

CONTRIBUTOR_SCOPE = (
    "contributor tokens read only their own contributor record, submissions, rewards and report, "
    "and ledger checkpoints and proofs"
)


def require_admin(principal: PrincipalDep) -> Principal:
    """Access: an admin API key."""
    if principal.role != "admin":
        raise forbidden(f"this needs an admin API key; the caller is a {principal.role}")
    return principal


def require_viewer(principal: PrincipalDep) -> Principal:
    """Access: a viewer or admin API key."""
    if principal.role == "contributor":
        raise forbidden(f"this needs a viewer or admin API key; {CONTRIBUTOR_SCOPE}")
    return principal


def require_self(principal: PrincipalDep, contributor_id: str) -> Principal:
    """Access: a viewer or admin API key, or the token of the contributor named in the path."""
    if principal.role == "contributor" and principal.contributor_id != contributor_id:
        raise forbidden(f"this belongs to another contributor; {CONTRIBUTOR_SCOPE}")
    return principal


def require_reader(principal: PrincipalDep) -> Principal:
    """Access: any API key or contributor token."""
    return principal


AdminDep = Annotated[Principal, Depends(require_admin)]
ViewerDep = Annotated[Principal, Depends(require_viewer)]
SelfDep = Annotated[Principal, Depends(require_self)]
ReaderDep = Annotated[Principal, Depends(require_reader)]

ACCESS: dict[Callable[..., Any], str] = {
    require_admin: "admin",
    require_viewer: "viewer",
    require_self: "self",
    require_reader: "reader",
}
ACCESS_TEXT = {
    "admin": "an admin API key",
    "viewer": "a viewer or admin API key",
    "self": "a viewer or admin API key, or the token of the contributor named in the path",
    "reader": "any API key or contributor token",
    "open": "none (no token needed)",
}


def route_access(route: APIRoute) -> set[str]:
    """The access levels a route's dependencies demand (empty: the route is open)."""
    found: set[str] = set()
    pending = list(route.dependant.dependencies)
    while pending:
        dep = pending.pop()
        if dep.call in ACCESS:
            found.add(ACCESS[dep.call])
        pending.extend(dep.dependencies)
    return found
