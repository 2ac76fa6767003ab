"""What an attack matrix is: its settings (`SweepConfig`), its cells, and what each cell
configures (the coordinator's settings, the data shards, which clients attack).

Running a sweep is `zoo_gym.simulation.experiment`'s job; its engines (in-process, batched
and Ray) build their federations from what is defined here.
"""

from __future__ import annotations

import hashlib
import math
import random
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from zoo_gym.aggregation import RULES, min_clients
from zoo_gym.client.byzantine import DATA_ATTACKS
from zoo_gym.core.partition import dirichlet_counts, label_counts, split
from zoo_gym.core.synthetic import TASKS, Record, shard
from zoo_gym.simulation.adversary import UPDATE_ATTACKS

ATTACK_NAMES = ("none", *UPDATE_ATTACKS, *DATA_ATTACKS)


class SweepError(ValueError):
    """A sweep config or flag holds a bad value (one-line message)."""


class SweepConfig(BaseModel):
    """One attack matrix; every field can come from a TOML file or a flag."""

    model_config = ConfigDict(extra="forbid")
    aggregators: list[str] = [
        "fedavg",
        "krum",
        "multikrum",
        "trimmed_mean",
        "median",
        "geometric_median",
    ]
    attacks: list[str] = ["sign_flip", "scaling", "alie", "ipm", "label_flip"]
    byzantine_shares: list[float] = [0.1, 0.2, 0.3]
    clients: int = Field(10, ge=2)
    rounds: int = Field(4, ge=1)
    warmup_rounds: int = Field(
        2,
        ge=0,
        description="honest FedAvg rounds every cell starts from (past the quick format-learning phase)",
    )
    steps: int = Field(10, ge=1, description="local training steps per round")
    learning_rate: float = Field(0.01, gt=0)
    batch_size: int = Field(8, ge=1)
    examples_per_client: int = Field(60, ge=4)
    task: Literal["addition", "arithmetic"] = Field(
        "addition",
        description="addition: sums in a few phrasings; arithmetic: add, subtract, multiply and "
        "compare, one class each (validation holds all four alike)",
    )
    partition: Literal["iid", "dirichlet", "labels"] = Field(
        "iid",
        description="iid: round robin; dirichlet: each client's class proportions from "
        "Dir(alpha * prior); labels: each client holds classes_per_client classes",
    )
    alpha: float = Field(0.5, gt=0, description="Dirichlet concentration (partition dirichlet)")
    classes_per_client: int = Field(
        1, ge=1, description="classes each client holds (partition labels)"
    )
    f: int | None = Field(
        None,
        ge=0,
        description="Byzantine updates the rules tolerate; default: attackers at the largest share",
    )
    pre_aggregation: str = "none"
    aggregator_params: dict[str, dict[str, float]] = {}
    attack_params: dict[str, dict[str, float]] = {}
    codec: str = "bitdelta"
    quality_gate: bool = Field(
        False, description="keep the coordinator's quality gate (off: measure the rule alone)"
    )
    coordinator: dict[str, Any] = Field(
        {},
        description="coordinator settings every federation runs with, as in coordinator.toml "
        "(e.g. clients_per_round, rewards.selection_floor); the rule, f, rounds, clients, "
        "seed and training steps come from the sweep's own fields",
    )
    engine: Literal["inprocess", "batched", "ray"] = Field(
        "inprocess",
        description="inprocess: a ClientApp and model per contributor; batched: contributors "
        "train together on one shared model (FFA-LoRA SFT); ray: Flower's simulation engine",
    )
    jobs: int = Field(
        1,
        ge=1,
        description="cells run in parallel (in-process and ray engines; ray without "
        "ray_address: also the CPUs of the local Ray it starts)",
    )
    ray_address: str | None = Field(
        None,
        description="engine ray: attach to the running Ray cluster at this address ('auto' or "
        "host:port) instead of starting a local one",
    )
    storage: Path | None = Field(
        None,
        description="engine ray: keep the contributors' own state (error feedback, privacy "
        "accounting) in files under this directory, which every Ray node must reach; "
        "default: Ray's object store",
    )
    seed: int = 0

    @model_validator(mode="after")
    def _check(self) -> SweepConfig:
        for rule in self.aggregators:
            if rule not in RULES:
                raise ValueError(f"unknown aggregator {rule!r}; choose from {', '.join(RULES)}")
        for attack in self.attacks:
            if attack not in ATTACK_NAMES or attack == "none":
                raise ValueError(
                    f"unknown attack {attack!r}; choose from {', '.join(ATTACK_NAMES[1:])}"
                )
        classes = len(TASKS[self.task].classes)
        if self.partition == "labels" and self.classes_per_client > classes:
            raise ValueError(
                f"the {self.task} task has {classes} classes; set classes_per_client to 1..{classes}"
            )
        for share in self.byzantine_shares:
            if not 0.0 < share < 0.5:
                raise ValueError(f"Byzantine shares must lie in (0, 0.5), got {share}")
        for rule in self.aggregators:
            needed = min_clients(rule, self.tolerated)
            if needed > self.clients:
                raise ValueError(
                    f"{rule} needs {needed} clients to tolerate f = {self.tolerated}; "
                    f"raise clients to {needed} or drop {rule}"
                )
        self._check_coordinator()
        return self

    def _check_coordinator(self) -> None:
        """Refuse coordinator settings the sweep sets itself, and invalid ones."""
        from zoo_gym.coordinator.config import CoordinatorConfig

        for key, field in _SWEEP_SETS.items():
            if key in self.coordinator:
                raise ValueError(f"coordinator.{key} is the sweep's to set; use {field} instead")
        for key in _SWEEP_SETS_TRAINING:
            if key in self.coordinator.get("training", {}):
                raise ValueError(
                    f"coordinator.training.{key} is the sweep's to set; use {key} instead"
                )
        try:
            CoordinatorConfig.model_validate(
                cell_overrides(self, Cell(self.aggregators[0], "none", 0.0))
            )
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(p) for p in err["loc"])
            raise ValueError(f"coordinator.{where}: {err['msg']}") from None

    @model_validator(mode="after")
    def _check_ray(self) -> SweepConfig:
        if self.engine != "ray" and (self.ray_address is not None or self.storage is not None):
            raise ValueError('ray_address and storage need engine = "ray" (--engine ray)')
        address = self.ray_address
        if address is not None and address != "auto":
            host, _, port = address.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"ray_address must be auto or host:port, not {address!r}")
        return self

    @property
    def tolerated(self) -> int:
        if self.f is not None:
            return self.f
        return max((self.attackers(s) for s in self.byzantine_shares), default=0)

    def attackers(self, share: float) -> int:
        return math.floor(share * self.clients + 0.5)

    def cells(self) -> Iterator[Cell]:
        for rule in self.aggregators:
            yield Cell(rule, "none", 0.0)
            for attack in self.attacks:
                for share in self.byzantine_shares:
                    yield Cell(rule, attack, share)


def load_sweep(path: Path | None, overrides: dict[str, Any]) -> SweepConfig:
    """The sweep in the TOML file `path` (or the defaults), with `overrides` on top."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            data = tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise SweepError(f"no sweep config at {path}; pass an existing --config file") from None
        except tomllib.TOMLDecodeError as exc:
            raise SweepError(f"{path} is not valid TOML ({exc})") from None
    try:
        return SweepConfig.model_validate({**data, **overrides})
    except ValidationError as exc:
        err = exc.errors()[0]
        where = "".join(f"{p}: " for p in (path, ".".join(str(p) for p in err["loc"])) if p)
        raise SweepError(where + err["msg"].removeprefix("Value error, ")) from None


# coordinator settings each cell derives from the sweep's fields: key -> the sweep field to use
_SWEEP_SETS = {
    "rounds": "rounds",
    "min_clients": "clients",
    "aggregator": "aggregators",
    "byzantine_f": "f",
    "aggregator_params": "aggregator_params",
    "pre_aggregation": "pre_aggregation",
    "seed": "seed",
    "selection_seed": "seed",
    "quality_gate_tolerance": "quality_gate",
}
_SWEEP_SETS_TRAINING = ("steps", "learning_rate", "batch_size", "codec")


@dataclass(frozen=True)
class Cell:
    aggregator: str
    attack: str
    share: float

    @property
    def name(self) -> str:
        return f"{self.aggregator}-{self.attack}-{round(self.share * 100):02d}"


@dataclass(frozen=True)
class CellResult:
    aggregator: str
    attack: str
    byzantine_share: float
    byzantine_clients: int
    f: int
    losses: tuple[float, ...]  # L_0 (initial base), then after each round
    published: int  # rounds whose aggregate was published
    byzantine_selected: float  # share of Byzantine updates the rule selected, over all rounds
    seconds: float

    @property
    def quality(self) -> float:
        return self.losses[0] - self.losses[-1]


def byzantine_indices(config: SweepConfig, share: float) -> list[int]:
    """Which clients attack at `share`: a seeded choice, nested across shares."""
    digest = hashlib.sha256(f"zoo-gym/byzantine|{config.seed}".encode()).digest()
    order = torch.randperm(
        config.clients, generator=torch.Generator().manual_seed(int.from_bytes(digest[:7], "big"))
    )
    return sorted(order[: config.attackers(share)].tolist())


def cell_overrides(config: SweepConfig, cell: Cell) -> dict[str, Any]:
    """Coordinator settings for one cell: the sweep's defaults, its `coordinator` table over
    them, and over both what the sweep's own fields and the cell set."""
    defaults = {
        "round_timeout_s": 3600.0,
        "wait_for_clients_s": 60.0,
        "rewards": {"method": "none"},  # the matrix measures the rule; scoring costs evaluations
    }
    fields = {
        "rounds": config.rounds,
        "min_clients": config.clients,
        "aggregator": cell.aggregator,
        "byzantine_f": config.tolerated,
        "aggregator_params": config.aggregator_params.get(cell.aggregator, {}),
        "pre_aggregation": config.pre_aggregation,
        "seed": config.seed,
        "quality_gate_tolerance": 0.02 if config.quality_gate else math.inf,
        "training": {
            "steps": config.steps,
            "learning_rate": config.learning_rate,
            "batch_size": config.batch_size,
            "codec": config.codec,
        },
    }
    return merged(merged(defaults, config.coordinator), fields)


def merged(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """`top` over `base`, tables merged key by key."""
    out = dict(base)
    for key, value in top.items():
        both = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = merged(out[key], value) if both else value
    return out


def shards_for(config: SweepConfig) -> list[list[Record]]:
    """Each client's records: `examples_per_client` of the sweep's task, split by its partition.

    IID is the round robin of `shard` over the task's records. The non-IID partitions draw a
    pool holding exactly the records of each class the counts ask for, then deal it out.
    """
    task = TASKS[config.task]
    n, size = config.clients, config.examples_per_client
    if config.partition == "iid":
        return shard(task.examples(n * size, seed=config.seed + 1), n)
    if config.partition == "dirichlet":
        counts = dirichlet_counts(task.prior, n, size, alpha=config.alpha, seed=config.seed + 2)
    else:
        counts = label_counts(
            task.prior, n, size, classes_per_client=config.classes_per_client, seed=config.seed + 2
        )
    rng = random.Random(config.seed + 1)
    labels = [c for c in range(len(task.prior)) for _ in range(sum(row[c] for row in counts))]
    pool = [task.example(c, rng) for c in labels]
    return [[pool[i] for i in indices] for indices in split(labels, counts, seed=config.seed + 3)]


def validation_records(config: SweepConfig) -> list[Record] | None:
    """The coordinator's validation split for the sweep's task, or None for the addition task
    (the tiny home's own `validation.jsonl`). Every class is there alike, whatever the partition."""
    if config.task == "addition":
        return None
    return TASKS[config.task].balanced(200, seed=config.seed + 10_000)
