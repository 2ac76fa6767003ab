"""A federation in one process: the coordinator's ServerApp and N ClientApps on the loopback Grid.

The coordinator, intake, ledger, aggregation and the clients' training are the
deployment code; only the wire is replaced by function calls. Used by tests
and by sweeps that need many rounds quickly.

Byzantine contributors come in two kinds. Under a data attack (`label_flip`,
`random_completion`) they are ordinary ClientApps training on poisoned records.
Under an update attack (`sign_flip`, `alie`, ...) they are registered keys whose
replies an omniscient `Adversary` crafts from the round's honest updates; they do
not train.
"""

from __future__ import annotations

import hashlib
import shutil
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flwr.app import Context, Message, RecordDict
from flwr.serverapp import Grid

from zoo_gym.client.app import make_client_app
from zoo_gym.client.byzantine import Misbehaviour
from zoo_gym.client.runtime import ClientRuntime
from zoo_gym.coordinator.backend import CoordinatorBackend
from zoo_gym.coordinator.config import CoordinatorConfig, load_config
from zoo_gym.coordinator.rounds import RoundSummary, run_server_app
from zoo_gym.coordinator.service import Coordinator
from zoo_gym.core.chat import to_conversation
from zoo_gym.core.identity import Identity
from zoo_gym.core.manifest import read_verified
from zoo_gym.core.protocol import register_statement
from zoo_gym.simulation.adversary import UPDATE_ATTACKS, Adversary
from zoo_gym.simulation.grid import SimulationGrid
from zoo_gym.simulation.sweep import ATTACK_NAMES
from zoo_gym.transport.loopback import LoopbackGrid


def node_identity(seed: int, index: int) -> Identity:
    """The key of simulated contributor `index` in a run with `seed`: the same contributors
    (and node ids) in every run with that seed, so seeded draws of contributors repeat."""
    return Identity.from_seed(
        hashlib.sha256(f"zoo-gym/simulated-contributor|{seed}|{index}".encode()).digest()
    )


@dataclass
class Roll:
    """The simulated contributors of a federation, registered: `trainers` (index, node id,
    key, attacker) of those who train, the keys of the attackers whose updates an adversary
    crafts (`crafted`, by node), and every attacker's contributor id (`bad`, by node)."""

    trainers: list[tuple[int, int, Identity, bool]]
    crafted: dict[int, Identity]
    bad: dict[int, str]


def enrol(co: Coordinator, count: int, byzantine: Collection[int], attack: str, seed: int) -> Roll:
    """Register `count` contributors with keys from `seed`; those whose index is in
    `byzantine` run `attack` (none when it is "none"), crafted by an adversary when it is an
    update attack."""
    roll = Roll([], {}, {})
    for i in range(count):
        identity = node_identity(seed, i)
        node = register(co.backend, identity, f"client-{i}")
        attacker = i in byzantine and attack != "none"
        if attacker:
            roll.bad[node] = identity.contributor_id
        if attacker and attack in UPDATE_ATTACKS:
            roll.crafted[node] = identity
        else:
            roll.trainers.append((i, node, identity, attacker))
    return roll


def register(backend: CoordinatorBackend, identity: Identity, name: str) -> int:
    """Register `identity` with the coordinator as a contributor would; returns its node id."""
    ts = int(time.time() * 1000)
    reg = backend.register(
        public_key=identity.public_key,
        name=name,
        timestamp_ms=ts,
        signature=identity.sign(register_statement(identity.public_key, name, ts)),
    )
    return reg.node_id


@dataclass
class InProcessFederation:
    coordinator: Coordinator
    runtimes: dict[int, ClientRuntime]
    grid: SimulationGrid
    byzantine: dict[int, str] = field(default_factory=dict)  # node id -> contributor id
    summaries: list[RoundSummary] = field(default_factory=list)

    @classmethod
    def build(
        cls,
        home: Path,
        shards: list[list[dict[str, str]]],
        *,
        overrides: dict[str, Any] | None = None,
        tamper: Callable[[int, Message], Message] | None = None,
        byzantine: Collection[int] = (),
        attack: str = "none",
        attack_params: Mapping[str, float] | None = None,
        seed: int = 0,
    ) -> InProcessFederation:
        """Shard i trains as client i; the clients whose index is in `byzantine` run `attack`."""
        if attack not in ATTACK_NAMES:
            raise ValueError(f"unknown attack {attack!r}; choose one of {', '.join(ATTACK_NAMES)}")
        config = load_config(home / "coordinator.toml")
        config = CoordinatorConfig.model_validate(
            {**config.model_dump(), "selection_seed": seed, **(overrides or {})}
        )
        co = Coordinator(config)
        source = registry_source(co)
        runtimes: dict[int, ClientRuntime] = {}
        nodes = {}
        roll = enrol(co, len(shards), byzantine, attack, seed)
        for i, node, identity, attacker in roll.trainers:
            records = shards[i]
            runtime = ClientRuntime(
                identity=identity,
                conversations=[to_conversation(r) for r in records],
                home=home / "clients" / f"client-{i}",
                model_source=source,
                misbehaviour=Misbehaviour(attack, dict(attack_params or {}), seed=seed + i)
                if attacker
                else None,
            )
            runtimes[node] = runtime
            nodes[node] = (make_client_app(runtime), client_context(node))
        adversary = colluders(attack, roll.crafted, config.byzantine_f, seed, attack_params)
        inner = LoopbackGrid(co.backend, nodes, spool=home / "spool", tamper=tamper, intake=False)
        grid = SimulationGrid(
            inner,
            co.backend,
            routes={n: n for n in nodes},
            spool=home / "spool",
            adversary=adversary,
        )
        return cls(co, runtimes, grid, roll.bad)

    def run(self, on_round: Callable[[RoundSummary], None] | None = None) -> list[RoundSummary]:
        return run_rounds(self.coordinator, self.grid, self.summaries, on_round)


def run_rounds(
    coordinator: Coordinator,
    grid: Grid,
    summaries: list[RoundSummary],
    on_round: Callable[[RoundSummary], None] | None,
) -> list[RoundSummary]:
    """The coordinator's round loop over `grid`, each round's summary appended to `summaries`
    (and given to `on_round`) as it ends; returns `summaries`."""

    def record(summary: RoundSummary) -> None:
        summaries.append(summary)
        if on_round is not None:
            on_round(summary)

    run_server_app(coordinator, grid, on_round=record)
    return summaries


def colluders(
    attack: str,
    crafted: dict[int, Identity],
    f: int,
    seed: int,
    params: Mapping[str, float] | None,
) -> Adversary | None:
    """The adversary that crafts the updates of the `crafted` nodes' keys, or None without any."""
    if not crafted:
        return None
    return Adversary(attack, crafted, f=f, seed=seed, params=dict(params or {}))


def registry_source(co: Coordinator) -> Callable[[str, Path], None]:
    """How in-process clients fetch a version: a copy of the coordinator's published directory,
    verified against its signing key as a downloaded one would be."""
    signer_key = co.signer.public_key

    def source(version: str, directory: Path) -> None:
        if not directory.exists():
            shutil.copytree(co.registry.root / version, directory)
        read_verified(directory, signer_key)

    return source


def client_context(node: int) -> Context:
    """The Flower context of the ClientApp of `node`."""
    return Context(run_id=1, node_id=node, node_config={}, state=RecordDict(), run_config={})
