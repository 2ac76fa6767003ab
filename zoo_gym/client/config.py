"""Contributor configuration: a TOML file written by `gym-client init`, overridable per flag."""

from __future__ import annotations

import tomllib
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class ClientConfigError(ValueError):
    """The client config is missing or holds a bad value."""


class ClientConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    home: Path = Path(".")
    name: str = "contributor"
    key: Path = Path("client.key")
    coordinator: str = ""
    data: Path | None = None
    ca_cert: Path | None = None
    device: str = "cpu"
    poll_wait_s: float = Field(10.0, gt=0, le=30)
    max_rounds: int = Field(0, ge=0, description="leave after this many submissions; 0 = stay")

    def path(self, value: Path) -> Path:
        return value if value.is_absolute() else self.home / value


def load_client_config(path: Path) -> ClientConfig:
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ClientConfigError(f"no client config at {path}; create one with `gym-client init`") from None
    except tomllib.TOMLDecodeError as exc:
        raise ClientConfigError(f"{path} is not valid TOML ({exc})") from None
    data.setdefault("home", str(path.parent.resolve()))
    try:
        return ClientConfig.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "config"
        raise ClientConfigError(f"{path}: {where}: {err['msg'].removeprefix('Value error, ')}") from None
