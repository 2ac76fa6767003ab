"""Coordinator configuration: one TOML file, validated on load.

Every field has a default that runs a small federation on one machine; a bad
value stops the coordinator with one line naming the key and what to put there.
"""

from __future__ import annotations

import os
from decimal import Decimal
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from zoo_gym.aggregation import RULES, aggregate, min_clients
from zoo_gym.aggregation.dispatch import PRE_STEPS
from zoo_gym.compression import CODECS
from zoo_gym.compression.spec import Granularity
from zoo_gym.core.protocol import BUILTIN_REWARDS, DEFAULT_TARGETS, Adapter, Objective
from zoo_gym.core.settings import HomeConfig, load_toml
from zoo_gym.core.weights import DEFAULT_SHARD_SIZE, parse_size
from zoo_gym.scoring import METHODS

DEFAULT_AGGREGATION_MEMORY = 2 << 30  # bytes; see `aggregation_memory`

AGGREGATORS = tuple(RULES)
Admission = Literal["open", "approval", "invite"]


class ConfigError(ValueError):
    """The configuration file is missing or holds a bad value."""


class TrainingPolicy(BaseModel):
    """What every contributor runs each round; each field travels in the round's `TaskConfig`."""

    model_config = ConfigDict(extra="forbid")
    method: Objective = Field("sft", description="objective: sft, grpo or gspo")
    adapter: Adapter = Field(
        "ffa_lora",
        description="ffa_lora sends B; lora, dora, qlora and full send dense weight deltas",
    )
    lora_rank: int = Field(8, ge=1, le=4096)
    lora_alpha: float = Field(16.0, gt=0)
    lora_a_rounds: int = Field(
        8,
        ge=1,
        le=1 << 20,
        description="ffa_lora: rounds one frozen A stays for (an epoch of A); the error-feedback "
        "residual carries losslessly within an epoch, and an epoch's first round also uploads it "
        "for the previous A (a second B per module), losing only its own compression error "
        "(bench/README.md)",
    )
    target_modules: list[str] = Field(default_factory=lambda: list(DEFAULT_TARGETS))
    steps: int = Field(30, ge=1)
    learning_rate: float = Field(5e-3, gt=0, le=1.0)
    batch_size: int = Field(8, ge=1)
    max_length: int = Field(96, ge=8)
    clip_norm: float = Field(0.0, ge=0, description="clip each update to this L2 norm; 0 = off")
    codec: str = "bitdelta"
    carry_codec: str = Field(
        "int8",
        description="ffa_lora: codec of the carried Bs an epoch's first round uploads (same "
        "group size and granularity as codec); at a change of A, int8 drops 0.4-1.1% of an "
        "update where bitdelta drops 36-69%, for 8.3 bits per carried value against 1.2; "
        "none (float32, 32 bits) drops nothing (bench/README.md)",
    )
    group_size: int = Field(128, ge=8, le=1 << 20)
    granularity: Granularity = Field(
        "group",
        description="one scale per group_size values, per row, or per matrix (the BitDelta paper)",
    )
    num_generations: int = Field(4, ge=2, le=64, description="GRPO/GSPO completions per prompt")
    max_new_tokens: int = Field(8, ge=1, le=4096)
    temperature: float = Field(1.0, gt=0, le=10)
    clip_epsilon: float = Field(0.2, gt=0, lt=1)
    kl_beta: float = Field(0.04, ge=0)
    reward_functions: list[str] = Field(
        default_factory=lambda: ["exact_answer"],
        description="built-in rewards summed per completion",
    )
    dp_noise_multiplier: float = Field(
        0.0, ge=0, description="DP-SGD noise multiplier; 0 = no DP-SGD"
    )
    dp_max_grad_norm: float = Field(1.0, gt=0)
    dp_target_epsilon: float = Field(
        0.0, ge=0, description="per-round epsilon; the client picks sigma"
    )
    dp_delta: float = Field(1e-5, gt=0, lt=1)
    dp_accountant: Literal["rdp", "prv"] = "rdp"
    update_noise_multiplier: float = Field(
        0.0, ge=0, description="Gaussian noise on the clipped update, std = this x clip_norm"
    )

    @model_validator(mode="after")
    def _consistent(self) -> TrainingPolicy:
        for key in ("codec", "carry_codec"):
            value = getattr(self, key)
            if value not in CODECS:
                raise ValueError(f"{key} must be one of {', '.join(CODECS)}, not {value!r}")
        unknown = [name for name in self.reward_functions if name not in BUILTIN_REWARDS]
        if unknown:
            raise ValueError(
                f"reward_functions may name only built-ins ({', '.join(BUILTIN_REWARDS)}), not {unknown[0]!r}; "
                "contributors add their own in their client config"
            )
        if self.update_noise_multiplier > 0 and self.clip_norm <= 0:
            raise ValueError(
                "update_noise_multiplier needs clip_norm > 0 (noise is scaled to the clipping norm)"
            )
        return self

    def task_fields(self) -> dict[str, Any]:
        """This policy as `TaskConfig` keyword arguments."""
        return {k: tuple(v) if isinstance(v, list) else v for k, v in self.model_dump().items()}


class RewardSettings(BaseModel):
    """How each round's contributions are scored and paid (see `zoo_gym.scoring`)."""

    model_config = ConfigDict(extra="forbid")
    method: str = Field(
        "individual",
        description="individual, leave_one_out, gtg_shapley, exact_shapley, first_order "
        "(one backward pass for all contributions), or none",
    )
    scoring_examples: int = Field(
        256,
        ge=1,
        description="validation records each scoring evaluation uses: a fixed sample drawn "
        "from the round's seed (the whole set when it is smaller)",
    )
    scoring_seconds: float = Field(
        600.0,
        ge=0,
        description="time budget for scoring one round; once spent, no evaluation starts and "
        "every contribution of the round is scored by first_order instead; 0 = no limit",
    )
    pool: Decimal = Field(Decimal(100), ge=0, description="paid per round, split by quality")
    min_quality: float = Field(
        0.0, ge=0, description="a contribution must improve validation utility by more"
    )
    unit: Decimal = Field(Decimal("0.000001"), gt=0, description="smallest amount paid")
    reputation_alpha: float = Field(
        0.2, gt=0, le=1, description="weight of the latest round in reputation"
    )
    reputation_weight: float = Field(
        0.0, ge=0, lt=1, description="how much reputation scales a reward"
    )
    selection_floor: float = Field(
        0.0,
        ge=0,
        le=1,
        description="with clients_per_round, sample by reputation with this floor (0: uniformly)",
    )

    @model_validator(mode="after")
    def _known(self) -> RewardSettings:
        if self.method != "none" and self.method not in METHODS:
            raise ValueError(
                f"method must be none or one of {', '.join(METHODS)}, not {self.method!r}"
            )
        if self.pool % self.unit != 0:
            raise ValueError(f"pool {self.pool} is not a whole number of units of {self.unit}")
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
    aggregator: str = Field(
        "median",
        description="robust by default: the coordinate-wise median tolerates any minority of bad updates",
    )
    aggregator_params: dict[str, float | int] = Field(
        default_factory=dict,
        description="passed to the rule: m (multikrum), tau and iters (centered_clipping), ...",
    )
    pre_aggregation: str = Field(
        "none", description="'nnm' mixes each update with its nearest neighbours first"
    )
    byzantine_f: int = Field(
        0, ge=0, description="Byzantine updates per round the rule must tolerate"
    )
    quality_gate_tolerance: float = Field(0.02, ge=0)
    shard_size: int = Field(
        DEFAULT_SHARD_SIZE,
        ge=1,
        description="largest weights file of a published version, in bytes or with a unit "
        '("2GB", "512MiB"); larger weights are written as shards with an index, as Hugging '
        "Face does",
    )
    aggregation_memory: int = Field(
        DEFAULT_AGGREGATION_MEMORY,
        ge=1 << 16,
        description="bytes the decoded updates may take while a round is aggregated, in bytes "
        'or with a unit ("2GiB"); when n x d float32 values need more, the payloads stay '
        "compressed and every rule reads column chunks of all n updates within this budget "
        "(BitDelta payloads with float16 scales stay compressed on the CPU whatever their size)",
    )
    # -- admission and intake (who may take part; what a submission must satisfy) --
    max_upload_bytes: int = Field(64 << 20, ge=1024)
    admission: Admission = Field(
        "open",
        description="who may register a new key: open (anyone, starting at zero trust), "
        "approval (held as pending until an operator approves) or invite (with a code)",
    )
    require_approval: bool = Field(
        False, description='older spelling of admission = "approval"; kept for old configs'
    )
    registration_rate_per_s: float = Field(
        1.0,
        ge=0,
        description="new keys registered per second, all addresses together; 0 = unlimited",
    )
    registration_burst: int = Field(
        50, ge=1, description="new keys registered at once before the rate applies"
    )
    registration_rate_per_address_per_s: float = Field(
        0.1, ge=0, description="new keys registered per second from one address; 0 = unlimited"
    )
    registration_burst_per_address: int = Field(20, ge=1)
    registration_reserve: int = Field(
        10,
        ge=0,
        description="of the overall allowance, the last keys kept for addresses that retry "
        "when told rather than keep asking while refused; must be below registration_burst",
    )
    trusted_reputation: float = Field(
        0.3,
        ge=0,
        le=1,
        description="reputation at which a contributor is fully trusted; below it, reward weight "
        "scales with reputation / this and aggregation weight with max(that, fresh_weight); 0 = trust everyone",
    )
    fresh_weight: float = Field(
        0.1, gt=0, le=1, description="aggregation weight of an untrusted update (weighted rules)"
    )
    clock_skew_s: float = Field(300.0, gt=0)
    max_submissions_per_round: int = Field(
        3,
        ge=1,
        description="submissions a contributor may make per round; the first one over is recorded, later ones not",
    )
    max_update_norm: float = Field(
        10000.0,
        ge=0,
        description="largest L2 norm of a decoded update when training.clip_norm is 0 (a set clip_norm "
        "derives the bound from it); 0 = no bound",
    )
    # -- gRPC service limits (every resource a caller can hold is bounded) --
    # checked in this order: open calls in all, per address (IPv4 /32, IPv6 /64), calls not yet
    # signed in, per contributor key; refusals are RESOURCE_EXHAUSTED saying when to retry
    grpc_max_open_calls: int = Field(
        4096, ge=1, description="gRPC calls open at once on the whole service"
    )
    max_concurrent_per_peer: int = Field(
        512,
        ge=1,
        description="open gRPC calls per address; a NAT of 100 contributors needs about 200",
    )
    grpc_rate_per_s: float = Field(
        100.0, gt=0, description="gRPC calls per second per address (refilled token bucket)"
    )
    grpc_burst: int = Field(
        400, ge=1, description="gRPC calls an address may make at once before the rate applies"
    )
    grpc_max_unauthenticated: int = Field(
        1024, ge=1, description="gRPC calls whose first message is not yet authenticated, in all"
    )
    grpc_max_unauthenticated_per_peer: int = Field(
        64, ge=1, description="gRPC calls not yet authenticated, per address"
    )
    max_calls_per_contributor: int = Field(
        4,
        ge=1,
        description="open gRPC calls per contributor key (a newer long poll replaces an older one)",
    )
    contributor_rate_per_s: float = Field(
        10.0, gt=0, description="gRPC calls per second per contributor key"
    )
    contributor_burst: int = Field(50, ge=1)
    grpc_workers: int = Field(
        8, ge=1, description="threads for blocking work (database, signatures, files, decoding)"
    )
    grpc_workers_per_peer: int = Field(
        4, ge=1, description="of grpc_workers, how many one address may hold at once"
    )
    grpc_workers_per_contributor: int = Field(
        2, ge=1, description="of grpc_workers, how many one contributor key may hold at once"
    )
    first_message_timeout_s: float = Field(
        10.0, gt=0, description="a gRPC call whose request has not arrived by then is ended"
    )
    upload_idle_timeout_s: float = Field(
        30.0, gt=0, description="an upload (or download) that moves no data for this long is ended"
    )
    grpc_refusal_delay_s: float = Field(
        1.0,
        ge=0,
        le=60,
        description="a gRPC call refused by a limit above, or a new key refused while the "
        "registration allowances are spent, is answered after this delay (a sleeping task, "
        "at most 1024 at once), so a flood paces itself; 0 = at once",
    )
    # -- REST API limits --
    api_auth_rate_per_s: float = Field(
        2.0, ge=0, description="REST sign-in calls per second per client address; 0 = unlimited"
    )
    api_auth_burst: int = Field(20, ge=1)
    api_max_failures: int = Field(
        10,
        ge=1,
        description="failed REST credentials an address, or a credential, may present before "
        "further failures are answered 429; a valid credential is always served",
    )
    api_lockout_s: float = Field(
        300.0, gt=0, description="how long a spent failure budget takes to refill completely"
    )
    api_refusal_delay_s: float = Field(
        1.0,
        ge=0,
        le=60,
        description="a request without a valid credential from an address, or naming a "
        "credential, whose failure budget is spent is answered 429 after this delay and "
        "without reaching the app, so a flood paces itself; 0 = at once",
    )
    api_max_body_bytes: int = Field(
        64 << 10,
        ge=1024,
        le=64 << 20,
        description="largest REST request body (the largest legitimate one, a policy change, "
        "is a few KiB); larger is answered 413 before it is read",
    )
    api_max_header_bytes: int = Field(
        16 << 10,
        ge=4096,
        le=1 << 20,
        description="largest REST request line plus headers; larger is answered 400",
    )
    api_read_timeout_s: float = Field(
        10.0,
        gt=0,
        le=600,
        description="seconds a REST client has to send a request's head, and again its body; "
        "a connection that trickles is closed",
    )
    api_max_connections_per_address: int = Field(
        64,
        ge=1,
        description="open REST connections one client address (an IPv6 /64) may hold; another "
        "is answered 503 and closed before it is read (behind a proxy every client is the "
        "proxy's address)",
    )
    api_docs: bool = Field(
        False,
        description="serve /docs and /redoc, and /openapi.json without a token; "
        "off: /openapi.json needs a viewer key",
    )
    # -- the rest --
    device: str = Field(
        "auto",
        description="where accepted updates are decoded and aggregated, and where contributions "
        "are merged and evaluated for scoring and the quality gate: auto (the first CUDA "
        "device when present, else the CPU), cpu, cuda or cuda:N; on CUDA BitDelta envelopes "
        "are decoded by the Triton kernels",
    )
    seed: int = 0
    selection_seed: int | None = Field(
        None,
        description="seed of each round's draw of contributors (with clients_per_round); "
        "unset: each draw comes from the operating system's randomness, so nobody can tell "
        "in advance who a round picks (set it only for reproducible simulations)",
    )
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_reload_s: float = Field(
        60.0,
        ge=0,
        description="how often serve checks tls_cert/tls_key for a renewed pair; 0 = never",
    )
    signing_key: Path = Path("coordinator.key")
    checkpoint_copy: Path | None = Field(
        None,
        description="a file every newly signed ledger checkpoint is appended to (JSON lines), "
        "for `gym-coordinator ledger verify --checkpoint`; put it on other storage than the "
        "database or ship it off the host. Unset: checkpoints are kept in the database only",
    )
    training: TrainingPolicy = Field(default_factory=lambda: TrainingPolicy.model_validate({}))
    rewards: RewardSettings = Field(default_factory=lambda: RewardSettings.model_validate({}))

    @field_validator("shard_size", "aggregation_memory", mode="before")
    @classmethod
    def _size(cls, value: Any) -> Any:
        return parse_size(value) if isinstance(value, str) else value

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        try:
            if value != "auto":
                torch.device(value)
        except RuntimeError:
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, not {value!r}") from None
        return value

    @model_validator(mode="after")
    def _check(self) -> CoordinatorConfig:
        if self.aggregator not in AGGREGATORS:
            raise ValueError(
                f"aggregator must be one of {', '.join(AGGREGATORS)}, not {self.aggregator!r}"
            )
        if self.pre_aggregation not in ("none", *PRE_STEPS):
            raise ValueError(
                f"pre_aggregation must be none or {', '.join(PRE_STEPS)}, not {self.pre_aggregation!r}"
            )
        needed = min_clients(self.aggregator, self.byzantine_f)
        if self.min_clients < needed:
            raise ValueError(
                f"{self.aggregator} with byzantine_f = {self.byzantine_f} needs at least {needed} updates per round; "
                f"set min_clients >= {needed} or lower byzantine_f"
            )
        # the rule checks its own parameters: run it once on a tiny input
        params: dict[str, Any] = dict(self.aggregator_params)
        aggregate(
            self.aggregator, torch.zeros(needed, 2), f=self.byzantine_f, pre=self.pre, **params
        )
        if self.require_approval and self.admission == "invite":
            raise ValueError(
                'require_approval = true contradicts admission = "invite"; '
                "remove require_approval (admission replaces it)"
            )
        if self.require_approval:
            self.admission = "approval"
        if self.registration_reserve >= self.registration_burst:
            raise ValueError(
                f"registration_reserve ({self.registration_reserve}) must be below "
                f"registration_burst ({self.registration_burst}); lower it or raise the burst"
            )
        if self.grpc_workers_per_peer > self.grpc_workers:
            raise ValueError("grpc_workers_per_peer must not exceed grpc_workers")
        if self.grpc_workers_per_contributor > self.grpc_workers_per_peer:
            raise ValueError("grpc_workers_per_contributor must not exceed grpc_workers_per_peer")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together: set both or neither")
        return self

    @property
    def pre(self) -> str | None:
        return None if self.pre_aggregation == "none" else self.pre_aggregation

    def grpc_limits(self) -> dict[str, Any]:
        """The gRPC service limits, as `zoo_gym.transport.limits.RateLimits` keyword arguments."""
        return {
            "max_open_calls": self.grpc_max_open_calls,
            "max_concurrent_per_peer": self.max_concurrent_per_peer,
            "peer_rate_per_s": self.grpc_rate_per_s,
            "peer_burst": self.grpc_burst,
            "max_unauthenticated_calls": self.grpc_max_unauthenticated,
            "max_unauthenticated_per_peer": self.grpc_max_unauthenticated_per_peer,
            "max_calls_per_contributor": self.max_calls_per_contributor,
            "contributor_rate_per_s": self.contributor_rate_per_s,
            "contributor_burst": self.contributor_burst,
            "workers": self.grpc_workers,
            "workers_per_peer": self.grpc_workers_per_peer,
            "workers_per_contributor": self.grpc_workers_per_contributor,
            "first_message_timeout_s": self.first_message_timeout_s,
            "upload_idle_timeout_s": self.upload_idle_timeout_s,
            "refusal_delay_s": self.grpc_refusal_delay_s,
        }

    @property
    def ledger_url(self) -> str:
        return self.database_url or f"sqlite:///{self.path('ledger.db')}"


DATABASE_URL_ENV = "ZOO_GYM_DATABASE_URL"
"""When set, the ledger database URL (it holds a password: containers pass it as a secret)."""
DATABASE_URL_FILE_ENV = "ZOO_GYM_DATABASE_URL_FILE"
"""When set, a file holding the ledger database URL (a Docker or systemd credential)."""


def database_url_from_environment() -> str:
    """The ledger URL the environment names: ``ZOO_GYM_DATABASE_URL``, else the first line of the
    file ``ZOO_GYM_DATABASE_URL_FILE`` names; '' when neither is set."""
    url = os.environ.get(DATABASE_URL_ENV, "").strip()
    if url:
        return url
    name = os.environ.get(DATABASE_URL_FILE_ENV, "").strip()
    if not name:
        return ""
    try:
        lines = Path(name).read_text().strip().splitlines()
    except OSError as exc:
        raise ConfigError(
            f"{DATABASE_URL_FILE_ENV}={name} cannot be read ({exc.strerror}); "
            "point it at the file holding the database URL"
        ) from None
    if not lines:
        raise ConfigError(f"{DATABASE_URL_FILE_ENV}={name} is empty; write the database URL in it")
    return lines[0].strip()


def load_config(path: Path) -> CoordinatorConfig:
    """Read and validate `path`; `home` defaults to the file's directory.

    The environment's database URL (`database_url_from_environment`) overrides ``database_url``.
    """
    config = load_toml(
        path, CoordinatorConfig, error=ConfigError, missing="create one with `gym-coordinator init`"
    )
    url = database_url_from_environment()
    if url:
        config = config.model_copy(update={"database_url": url})
    return config
