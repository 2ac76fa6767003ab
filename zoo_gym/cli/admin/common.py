"""What every `gym-coordinator admin` command shares: the REST client made from `--url`,
`--token` and `--ca-cert` (or the environment), one-line errors, and table or JSON output."""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, ParamSpec, TypeVar

import typer
from rich.table import Table

from zoo_gym.cli.common import console, err_console
from zoo_gym.transport.rest import RestClient, RestError, RestRefused

P = ParamSpec("P")
R = TypeVar("R")

DEFAULT_URL = "http://127.0.0.1:8080"
HEADERS = {
    "base_version": "base",
    "new_version": "new",
    "contributor_id": "contributor",
    "round_number": "round",
    "reputation_after": "reputation",
    "status_reason": "reason",
    "size_bytes": "bytes",
    "published_at": "published",
    "created_at": "created",
    "closed_at": "closed",
    "round_status": "status",
}
ISO_TIME = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d")


class Format(StrEnum):
    table = "table"
    json = "json"


FormatOpt = Annotated[
    Format, typer.Option("--format", "-f", help="table for people, json for programs")
]
ReasonOpt = Annotated[str, typer.Option("--reason", "-r", help="why (goes into the audit log)")]


class AdminError(Exception):
    """A request the user can fix: the message is the whole story."""


@dataclass
class Api:
    """The REST client, made on first use (so a bad `--url` or `--ca-cert` is a command's
    one-line error); refusals are phrased for an operator."""

    url: str
    token: str | None
    timeout: float
    ca_cert: Path | None = None
    _rest: RestClient | None = None

    def _client(self) -> RestClient:
        if self._rest is None:
            try:
                self._rest = RestClient(
                    self.url,
                    token=self.token,
                    ca_cert=self.ca_cert,
                    timeout_s=self.timeout,
                    unreachable="check --url and that `gym-coordinator serve` is running",
                )
            except RestError as exc:
                raise AdminError(str(exc)) from None
        return self._rest

    def call(
        self, method: str, path: str, *, params: dict[str, Any] | None = None, body: Any = None
    ) -> Any:
        """One request; the decoded JSON answer."""
        try:
            return self._client().call(method, path, params=params, body=body)
        except RestRefused as exc:
            raise AdminError(_refused(exc)) from None
        except RestError as exc:
            raise AdminError(str(exc)) from None

    def download(self, path: str, target: Path, *, sha256: str) -> None:
        """Stream `path` into `target`, checking its SHA-256 against `sha256`."""
        try:
            self._client().download(path, target, sha256=sha256)
        except RestRefused as exc:
            raise AdminError(_refused(exc)) from None
        except RestError as exc:
            raise AdminError(str(exc)) from None


def _refused(exc: RestRefused) -> str:
    if exc.status_code == 401:
        return f"not authenticated: {exc.detail}; pass --token or set ZOO_GYM_TOKEN"
    if exc.status_code == 403:
        return f"not allowed: {exc.detail}"
    return f"{exc.detail} (HTTP {exc.status_code})"


def command(fn: Callable[P, R]) -> Callable[P, R]:
    """User errors print `error: <one line>` and exit 1; Ctrl-C exits 130."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except AdminError as exc:
            err_console.print(f"error: {exc}", markup=False, soft_wrap=True)
            raise typer.Exit(1) from None
        except KeyboardInterrupt:
            err_console.print("stopped.")
            raise typer.Exit(130) from None

    return wrapper


def main(
    ctx: typer.Context,
    url: Annotated[
        str, typer.Option(envvar="ZOO_GYM_URL", help="the coordinator's REST address")
    ] = DEFAULT_URL,
    token: Annotated[
        str | None,
        typer.Option(
            envvar="ZOO_GYM_TOKEN",
            show_default=False,
            help="API key (gym-coordinator apikey create)",
        ),
    ] = None,
    timeout: Annotated[float, typer.Option(help="seconds to wait for an answer")] = 30.0,
    ca_cert: Annotated[
        Path | None,
        typer.Option(
            envvar="ZOO_GYM_CA_CERT",
            help="CA certificate of a TLS coordinator (gym-coordinator init --tls)",
        ),
    ] = None,
) -> None:
    """Operate a running coordinator through its REST API."""
    ctx.obj = Api(url.rstrip("/"), token, timeout, ca_cert)


def get_api(ctx: typer.Context) -> Api:
    """The client the `admin` group's options made for this command."""
    api = ctx.find_object(Api)
    if api is None:  # only when a command is invoked without the group
        api = Api(DEFAULT_URL, None, 30.0)
    return api


# --- output -------------------------------------------------------------------------------------


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, str) and ISO_TIME.match(value):
        return value[:16].replace("T", " ")
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, dict | list):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def _short(value: Any) -> str:
    text = _cell(value)
    return text[:12] if len(text) == 32 and all(c in "0123456789abcdef" for c in text) else text


def table(
    rows: Iterable[dict[str, Any]],
    columns: list[str],
    *,
    title: str | None = None,
    short: Iterable[str] = (),
) -> Table:
    shorten = set(short)
    out = Table(title=title)
    for name in columns:
        out.add_column(HEADERS.get(name, name), overflow="fold")
    for row in rows:
        out.add_row(*[(_short if c in shorten else _cell)(row.get(c)) for c in columns])
    return out


def fields(data: dict[str, Any], *, title: str | None = None, skip: Iterable[str] = ()) -> Table:
    out = Table(title=title, show_header=False)
    out.add_column("field", style="bold")
    out.add_column("value", overflow="fold")
    for key, value in data.items():
        if key not in set(skip):
            out.add_row(key, _cell(value))
    return out


def emit(data: Any, fmt: Format, *tables: Table) -> None:
    if fmt is Format.json:
        typer.echo(json.dumps(data, indent=2, sort_keys=True))
        return
    for t in tables:
        console.print(t)
