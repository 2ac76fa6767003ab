"""Coordinator configuration: one TOML file, validated on load.

Every field has a default that runs a small federation on one machine; a bad
value stops the coordinator with one line naming the key and what to put there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from zoo_gym.aggregation import RULES
from zoo_gym.compression import CODECS
from zoo_gym.core.settings import HomeConfig, load_toml

AGGREGATORS = tuple(RULES)


class ConfigError(ValueError):
    """The configuration file is missing or holds a bad value."""


class TrainingPolicy(BaseModel):
    model_config = ConfigDict(extra="forbid")
    method: Literal["ffa_lora"] = "ffa_lora"
    lora_rank: int = Field(8, ge=1, le=1024)
    lora_alpha: float = Field(16.0, gt=0)
    target_modules: list[str] = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    steps: int = Field(30, ge=1)
    learning_rate: float = Field(5e-3, gt=0, le=1.0)
    batch_size: int = Field(8, ge=1)
    max_length: int = Field(96, ge=8)
    clip_norm: float = Field(0.0, ge=0)
    codec: str = "bitdelta"
    group_size: int = Field(128, ge=8, le=1 << 20)

    @model_validator(mode="after")
    def _codec_known(self) -> TrainingPolicy:
        if self.codec not in CODECS:
            raise ValueError(f"codec must be one of {', '.join(CODECS)}, not {self.codec!r}")
        return self


class CoordinatorConfig(HomeConfig):
    listen: str = "127.0.0.1:7443"
    rest_listen: str = "127.0.0.1:8080"
    database_url: str = ""
    base_model: str = "base"
    validation_data: Path = Path("validation.jsonl")
    rounds: int = Field(0, ge=0, description="rounds to run; 0 runs until stopped")
    min_clients: int = Field(2, ge=1)
    clients_per_round: int = Field(0, ge=0, description="0 = every connected client")
    wait_for_clients_s: float = Field(600.0, gt=0)
    round_timeout_s: float = Field(600.0, gt=0)
    quorum: int = Field(1, ge=1, description="accepted updates needed to aggregate")
    aggregator: str = "fedavg"
    byzantine_f: int = Field(0, ge=0)
    quality_gate_tolerance: float = Field(0.02, ge=0)
    max_upload_bytes: int = Field(64 << 20, ge=1024)
    require_approval: bool = False
    clock_skew_s: float = Field(300.0, gt=0)
    seed: int = 0
    tls_cert: Path | None = None
    tls_key: Path | None = None
    signing_key: Path = Path("coordinator.key")
    training: TrainingPolicy = Field(default_factory=lambda: TrainingPolicy.model_validate({}))

    @model_validator(mode="after")
    def _check(self) -> CoordinatorConfig:
        if self.aggregator not in AGGREGATORS:
            raise ValueError(f"aggregator must be one of {', '.join(AGGREGATORS)}, not {self.aggregator!r}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together: set both or neither")
        return self

    @property
    def ledger_url(self) -> str:
        return self.database_url or f"sqlite:///{self.path('ledger.db')}"


def load_config(path: Path) -> CoordinatorConfig:
    """Read and validate `path`; `home` defaults to the file's directory."""
    return load_toml(path, CoordinatorConfig, error=ConfigError, missing="create one with `gym-coordinator init`")
