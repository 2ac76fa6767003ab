"""Contributor configuration: a TOML file written by `gym-client init`, overridable per flag."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import Field, field_validator

from zoo_gym.client.device import check_device_name
from zoo_gym.core.settings import HomeConfig, load_toml

if TYPE_CHECKING:
    from zoo_gym.client.privacy import PrivacyBudget


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
    invite: str = Field(
        "",
        description="the invitation code the operator gave you, sent when registering "
        "(needed where the coordinator admits by invitation)",
    )
    data: Path | None = None
    ca_cert: Path | None = Field(
        None, description="CA certificate of the coordinator's TLS; unset: the system's trusted CAs"
    )
    plaintext: bool = Field(
        False,
        description="connect without TLS to a coordinator on another machine (private networks only); "
        "a loopback address is always plaintext unless ca_cert is set",
    )
    device: str = Field(
        "auto",
        description="where to train: auto (CUDA when present, else the CPU), cpu, cuda, cuda:N",
    )
    poll_wait_s: float = Field(10.0, gt=0, le=30)
    max_rounds: int = Field(0, ge=0, description="leave after this many submissions; 0 = stay")
    reconnect_for_s: float = Field(
        600.0,
        ge=0,
        description="how long `join` keeps trying to reach a coordinator it lost (a restart, a "
        "network outage) before it gives up; 0 = give up at once",
    )
    byzantine: str = Field(
        "", description="attack the federation on purpose (demos and drills); empty = honest"
    )
    clock_offset_s: float = Field(
        0.0,
        description="added to this machine's clock when signing requests (correct a clock you cannot fix)",
    )
    privacy_budget_epsilon: float | None = Field(
        None,
        gt=0,
        description="refuse rounds that would take your records' total epsilon past this; unset = no limit",
    )
    privacy_budget_delta: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="delta at which the budget is checked; unset = each task's dp_delta",
    )
    method: Literal["any", "sft", "grpo", "gspo"] = Field(
        "any",
        description="the training objective you accept; a round asking for another stops `join`",
    )
    reward_functions: list[str] = Field(
        default_factory=list,
        description='your own GRPO reward functions as "module:function" import paths',
    )
    error_feedback: bool = Field(
        True, description="carry what compression dropped into the next round's update"
    )
    gradient_checkpointing: bool = Field(
        False, description="recompute activations in the backward pass: less memory, slower"
    )
    max_full_params: int = Field(
        1_000_000_000, gt=0, description="largest model (parameters) a `full` round may train"
    )
    app: str = Field(
        "",
        description='your own Flower ClientApp as "package.module:attribute", which trains each '
        "round in place of zoo-gym's trainers (README: Bring your own Flower ClientApp); "
        "empty = zoo-gym's trainers on `data`",
    )
    node_config: dict[str, int | float | str | bool] = Field(
        default_factory=dict,
        description="settings your ClientApp reads from Context.node_config (e.g. partition-id)",
    )

    @field_validator("api_url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        if value and not value.startswith(("http://", "https://")):
            raise ValueError(f"api_url must start with http:// or https://, not {value!r}")
        return value.rstrip("/")

    @field_validator("app")
    @classmethod
    def _app_path(cls, value: str) -> str:
        module, _, attribute = value.partition(":")
        if value and (not module or not attribute):
            raise ValueError(
                f"app must be MODULE:ATTRIBUTE, like package.module:app, not {value!r}"
            )
        return value

    @field_validator("device")
    @classmethod
    def _device_name(cls, value: str) -> str:
        return check_device_name(value)

    @field_validator("byzantine")
    @classmethod
    def _known_attack(cls, value: str) -> str:
        from zoo_gym.client.byzantine import BYZANTINE_ATTACKS

        if value and value not in BYZANTINE_ATTACKS:
            raise ValueError(
                f"byzantine must be one of {', '.join(BYZANTINE_ATTACKS)}, not {value!r}"
            )
        return value

    def privacy_budget(self) -> PrivacyBudget | None:
        """The budget `join` enforces (None: no limit)."""
        from zoo_gym.client.privacy import PrivacyBudget

        if self.privacy_budget_epsilon is None:
            return None
        return PrivacyBudget(self.privacy_budget_epsilon, self.privacy_budget_delta)


def load_client_config(path: Path) -> ClientConfig:
    return load_toml(
        path,
        ClientConfig,
        error=ClientConfigError,
        missing="create one with `gym-client init`",
        kind="client config",
    )
