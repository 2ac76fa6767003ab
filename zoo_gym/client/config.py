"""Contributor configuration: a TOML file written by `gym-client init`, overridable per flag."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator

from zoo_gym.core.settings import HomeConfig, load_toml


class ClientConfigError(ValueError):
    """The client config is missing or holds a bad value."""


class ClientConfig(HomeConfig):
    name: str = "contributor"
    key: Path = Path("client.key")
    coordinator: str = ""
    api_url: str = Field(
        "",
        description="the coordinator's REST address, e.g. http://HOST:8080 (`gym-client rewards`)",
    )
    data: Path | None = None
    ca_cert: Path | None = None
    device: str = "cpu"
    poll_wait_s: float = Field(10.0, gt=0, le=30)
    max_rounds: int = Field(0, ge=0, description="leave after this many submissions; 0 = stay")
    byzantine: str = Field(
        "", description="attack the federation on purpose (demos and drills); empty = honest"
    )

    @field_validator("api_url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        if value and not value.startswith(("http://", "https://")):
            raise ValueError(f"api_url must start with http:// or https://, not {value!r}")
        return value.rstrip("/")

    @field_validator("byzantine")
    @classmethod
    def _known_attack(cls, value: str) -> str:
        from zoo_gym.client.byzantine import BYZANTINE_ATTACKS

        if value and value not in BYZANTINE_ATTACKS:
            raise ValueError(
                f"byzantine must be one of {', '.join(BYZANTINE_ATTACKS)}, not {value!r}"
            )
        return value


def load_client_config(path: Path) -> ClientConfig:
    return load_toml(
        path,
        ClientConfig,
        error=ClientConfigError,
        missing="create one with `gym-client init`",
        kind="client config",
    )
