"""The HTTP client of a coordinator's REST API, for `gym-coordinator admin` and `gym-client rewards`.

One `httpx.Client` per `RestClient` (connections are kept alive between calls), TLS checked
against a given CA certificate or else the system's trusted ones, the bearer token sent when one
is set. What goes wrong becomes one line: `RestError` when the coordinator cannot be reached or
does not answer like one, `RestRefused` (with the status code and the server's own `detail`) when
it answers with an error status; each caller adds what its user should do about it.
"""

from __future__ import annotations

import hashlib
import ssl
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx


class RestError(Exception):
    """The request failed; the message is one line."""


class RestRefused(RestError):
    """The coordinator answered with an error status; `detail` is its reason, in one line."""

    def __init__(self, status_code: int, detail: str, path: str) -> None:
        super().__init__(f"the coordinator answered {status_code} to {path}: {detail}")
        self.status_code = status_code
        self.detail = detail
        self.path = path


def rest_base(url: str) -> str:
    """The REST base address `url` (http:// or https://), without a trailing slash."""
    if not url.startswith(("http://", "https://")):
        raise RestError(f"the REST address must start with http:// or https://, e.g. http://{url}")
    return url.rstrip("/")


def error_detail(response: httpx.Response) -> str:
    """The one-line reason of an error answer: FastAPI's `detail`, a string or a list of
    validation errors (the first one, with where it was)."""
    try:
        detail = response.json().get("detail")
    except (ValueError, AttributeError):
        return response.text.strip()[:300] or response.reason_phrase or "no detail"
    if isinstance(detail, list) and detail and isinstance(detail[0], dict):
        first = detail[0]
        where = ".".join(str(p) for p in first.get("loc", [])[1:])
        message = str(first.get("msg", first))
        return f"{where}: {message}" if where else message
    return str(detail) if detail else response.reason_phrase or "no detail"


class RestClient:
    """Calls to the REST API at `url`. `token` is sent as a bearer token when set (it may be
    set later, after a sign-in); `unreachable` is the advice added when no answer comes."""

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        ca_cert: Path | None = None,
        timeout_s: float = 30.0,
        unreachable: str = "check the address and that `gym-coordinator serve` is running",
    ) -> None:
        self.base = rest_base(url)
        self.token = token
        self.unreachable = unreachable
        verify: ssl.SSLContext | bool = True
        if ca_cert is not None:
            try:
                verify = ssl.create_default_context(cafile=str(ca_cert))
            except (OSError, ssl.SSLError) as exc:
                raise RestError(f"cannot read the CA certificate {ca_cert}: {exc}") from None
        self.http = httpx.Client(base_url=self.base, timeout=timeout_s, verify=verify)

    def __enter__(self) -> RestClient:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        self.http.close()

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def _no_answer(self, path: str, exc: Exception) -> RestError:
        return RestError(
            f"cannot reach the coordinator's REST API at {self.base}{path} "
            f"({type(exc).__name__}: {exc}); {self.unreachable}"
        )

    def call(
        self,
        method: str,
        path: str,
        *,
        params: dict[str, Any] | None = None,
        body: Any = None,
    ) -> Any:
        """The decoded JSON answer to one request (None for an empty one); parameters whose
        value is None are left out."""
        params = {k: v for k, v in (params or {}).items() if v is not None}
        try:
            response = self.http.request(
                method, path, params=params, json=body, headers=self._headers()
            )
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            raise self._no_answer(path, exc) from None
        if response.status_code >= 400:
            raise RestRefused(response.status_code, error_detail(response), path)
        if not response.content:
            return None
        try:
            return response.json()
        except ValueError:
            raise RestError(
                f"{self.base} did not answer {path} with JSON; "
                "is that the coordinator's REST address?"
            ) from None

    def download(self, path: str, target: Path, *, sha256: str) -> None:
        """Stream `path` into `target`, checking its SHA-256 against `sha256`; nothing is left
        at `target` when it differs."""
        digest = hashlib.sha256()
        partial = target.with_name(target.name + ".part")
        try:
            with self.http.stream("GET", path, headers=self._headers()) as response:
                if response.status_code >= 400:
                    response.read()
                    raise RestRefused(response.status_code, error_detail(response), path)
                with partial.open("wb") as fh:
                    for chunk in response.iter_bytes():
                        digest.update(chunk)
                        fh.write(chunk)
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            partial.unlink(missing_ok=True)
            raise self._no_answer(path, exc) from None
        if digest.hexdigest() != sha256:
            partial.unlink()
            raise RestError(f"{target.name}: SHA-256 differs from the manifest; not saved")
        partial.replace(target)
