"""Fetching a contributor's statement: sign in with the contributor key (`POST /auth/challenge`,
sign `rest_challenge_statement`, `POST /auth/token`; the token reads only this contributor's own
records), then `GET /contributors/{id}/report`.

The REST address is `--api` or `api_url` in client.toml; an https address is checked against the
config's `ca_cert` when one is set, else against the system's trusted CAs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from zoo_gym.client.report.statement import RewardsError, Statement
from zoo_gym.client.state import LocalState
from zoo_gym.core.identity import Identity
from zoo_gym.core.protocol import rest_challenge_statement
from zoo_gym.transport.rest import RestClient, RestError, RestRefused, rest_base


class ApiRefused(RewardsError):
    """The coordinator answered a request with an error status."""

    def __init__(self, status_code: int, message: str) -> None:
        super().__init__(message)
        self.status_code = status_code


def api_base(url: str) -> str:
    """The REST base address `url` (http:// or https://), without a trailing slash."""
    if not url:
        raise RewardsError(
            "no REST address: pass --api http://HOST:PORT or set api_url in client.toml"
        )
    try:
        return rest_base(url)
    except RestError as exc:
        raise RewardsError(str(exc)) from None


def connect(url: str, *, ca_cert: Path | None = None, timeout_s: float = 30.0) -> RestClient:
    """A client of the REST API at `url` (TLS checked against `ca_cert` when given)."""
    try:
        return RestClient(
            api_base(url),
            ca_cert=ca_cert,
            timeout_s=timeout_s,
            unreachable="check --api or api_url in client.toml",
        )
    except RestError as exc:
        raise RewardsError(str(exc)) from None


class ReportApi:
    """The coordinator's REST API as one contributor sees it (signed in with its own key)."""

    def __init__(self, rest: RestClient, identity: Identity, token: str = "") -> None:
        self.rest = rest
        self.identity = identity
        if token:
            rest.token = token

    @property
    def contributor_id(self) -> str:
        return self.identity.contributor_id

    @property
    def token(self) -> str:
        """The bearer token of the last sign-in ("" before one)."""
        return self.rest.token or ""

    def _refusal(self, refused: RestRefused) -> str:
        code, detail, path = refused.status_code, refused.detail, refused.path
        if path.startswith("/auth/"):
            return (
                f"the coordinator refused to sign in contributor {self.contributor_id} "
                f"({code}: {detail}); has this key joined the network (`gym-client join`)?"
            )
        if code == 401:
            return f"the coordinator refused the sign-in token ({detail}); try again"
        if code == 403:
            return f"the coordinator refused access to {path} (403: {detail})"
        return f"the coordinator answered {code} to {path}: {detail}"

    def call(
        self,
        method: str,
        path: str,
        *,
        body: dict[str, Any] | None = None,
        params: dict[str, Any] | None = None,
    ) -> Any:
        """The JSON answer to one request; `RewardsError` for anything the user can act on."""
        try:
            return self.rest.call(method, path, body=body, params=params)
        except RestRefused as exc:
            raise ApiRefused(exc.status_code, self._refusal(exc)) from None
        except RestError as exc:
            raise RewardsError(str(exc)) from None

    def sign_in(self) -> None:
        """Answer a sign-in challenge with the contributor key; keep the token."""
        self.rest.token = None
        cid = self.contributor_id
        challenge = self.call("POST", "/auth/challenge", body={"contributor_id": cid})
        statement = rest_challenge_statement(
            cid, str(challenge["nonce"]), int(challenge["expires_at_ms"])
        )
        answer = {
            "contributor_id": cid,
            "nonce": challenge["nonce"],
            "signature": self.identity.sign(statement).hex(),
        }
        self.rest.token = str(self.call("POST", "/auth/token", body=answer)["access_token"])

    def get(self, path: str, params: dict[str, Any] | None = None) -> Any:
        """GET `path` signed in; a token that expired on the way is renewed once."""
        if not self.rest.token:
            self.sign_in()
        try:
            return self.call("GET", path, params=params)
        except ApiRefused as exc:
            if exc.status_code != 401:
                raise
        self.sign_in()
        return self.call("GET", path, params=params)


def pinned_coordinator_key(state_path: Path) -> bytes:
    """The coordinator's signing key that `gym-client join` pinned in `state_path`."""
    try:
        pinned = LocalState.load(state_path).coordinator_key
    except (ValueError, TypeError) as exc:
        raise RewardsError(f"{state_path} is not readable client state ({exc})") from None
    if not pinned:
        raise RewardsError(
            f"no coordinator key is pinned in {state_path}; run `gym-client join` once "
            "(it pins the key the coordinator signs with), then verify"
        )
    try:
        return bytes.fromhex(pinned)
    except ValueError:
        raise RewardsError(f"{state_path}: coordinator_key is not hex") from None


def fetch_statement(api: ReportApi) -> Statement:
    """Sign in (if needed) and fetch the contributor's own report."""
    data = api.get(f"/contributors/{api.contributor_id}/report")
    if not isinstance(data, dict):
        raise RewardsError("the coordinator's report is not a JSON object; update zoo-gym")
    return Statement.from_json(data)
