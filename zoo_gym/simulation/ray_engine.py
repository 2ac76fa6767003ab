"""A sweep cell on Flower's simulation engine (Ray): the same ServerApp and ClientApp code.

Flower runs the virtual SuperNodes' ClientApps in Ray actors and hands our round loop
its own Grid. Two things differ from deployment, both handled here:

- identity: each virtual contributor's Ed25519 key is derived from the sweep seed and
  its partition id, so whichever actor runs a node signs with the same key. Before
  the first round the coordinator sends every node a query; the reply is a signed
  registration, which the coordinator's backend checks like a `Register` call.
- state: an actor may serve different nodes in turn, so a ClientApp builds its
  contributor runtime per message from the node's directory (model files, error
  feedback and local state live on disk), instead of keeping it in memory as the
  long-lived `join` process does.

Byzantine contributors under an update attack are not Ray nodes: `SimulationGrid`'s
adversary crafts their replies on the coordinator's side, as in-process.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from zoo_gym.client.byzantine import Misbehaviour
from zoo_gym.client.runtime import ClientRuntime
from zoo_gym.coordinator.config import CoordinatorConfig, load_config
from zoo_gym.coordinator.rounds import RoundSummary, run_rounds
from zoo_gym.coordinator.service import Coordinator
from zoo_gym.core.chat import to_conversation
from zoo_gym.core.manifest import read_verified
from zoo_gym.core.protocol import SignedRegistration
from zoo_gym.simulation.adversary import UPDATE_ATTACKS, Adversary
from zoo_gym.simulation.grid import SimulationGrid
from zoo_gym.simulation.inprocess import node_identity, register
from zoo_gym.simulation.sweep import Cell, SweepConfig, cell_overrides, shards_for

log = logging.getLogger(__name__)
REGISTRATION = "registration"


def make_simulated_client_app(
    *,
    shards: Sequence[list[dict[str, str]]],
    clients: Sequence[int],
    misbehaviour: dict[int, Misbehaviour],
    seed: int,
    workdir: Path,
    registry: Path,
    coordinator_key: bytes,
) -> ClientApp:
    """A ClientApp whose partition p is contributor `clients[p]`, training on `shards[clients[p]]`."""
    app = ClientApp()

    def index(context: Context) -> int:
        partition = context.node_config["partition-id"]
        assert isinstance(partition, int), f"partition-id must be an int, got {partition!r}"
        return clients[partition]

    def source(version: str, directory: Path) -> None:
        if not directory.exists():
            shutil.copytree(registry / version, directory)
        read_verified(directory, coordinator_key)

    @app.query()
    def hello(message: Message, context: Context) -> Message:
        i = index(context)
        registration = SignedRegistration.now(
            node_identity(seed, i), f"client-{i}", int(time.time() * 1000)
        )
        record = ConfigRecord(registration.to_record())
        return Message(RecordDict({REGISTRATION: record}), reply_to=message)

    @app.train()
    def train(message: Message, context: Context) -> Message:
        i = index(context)
        runtime = ClientRuntime(
            identity=node_identity(seed, i),
            conversations=[to_conversation(r) for r in shards[i]],
            home=workdir / f"client-{i}",
            model_source=source,
            misbehaviour=misbehaviour.get(i),
        )
        return runtime.train(message)

    return app


def register_nodes(
    grid: Grid, co: Coordinator, *, expected: int, timeout_s: float = 600.0
) -> dict[int, int]:
    """Ask every engine node for its signed registration; coordinator node id -> engine node id."""
    deadline = time.monotonic() + timeout_s
    nodes = list(grid.get_node_ids())
    while len(nodes) < expected:  # the engine brings its nodes up after the ServerApp starts
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"{len(nodes)} of {expected} simulated nodes came up in {timeout_s:.0f} s"
            )
        time.sleep(0.2)
        nodes = list(grid.get_node_ids())
    queries = [Message(RecordDict(), n, MessageType.QUERY, group_id="register") for n in nodes]
    routes: dict[int, int] = {}
    for reply in grid.send_and_receive(queries, timeout=600):
        if reply.has_error():
            raise RuntimeError(
                f"node {reply.metadata.src_node_id} failed to register: {reply.error.reason}"
            )
        asked = SignedRegistration.from_record(reply.content.config_records[REGISTRATION])
        reg = co.backend.register(
            public_key=asked.public_key,
            name=asked.name,
            timestamp_ms=asked.timestamp_ms,
            signature=asked.signature,
        )
        routes[reg.node_id] = reply.metadata.src_node_id
    if len(routes) != len(nodes):
        raise RuntimeError(f"{len(routes)} of {len(nodes)} simulated nodes registered")
    return routes


def run_ray_federation(
    config: SweepConfig, cell: Cell, home: Path, attackers: Sequence[int]
) -> tuple[list[RoundSummary], Coordinator, set[str]]:
    """Run one cell on Flower's simulation engine; returns its rounds, coordinator and attackers' ids."""
    from flwr.simulation import run_simulation

    base = load_config(home / "coordinator.toml")
    co = Coordinator(
        CoordinatorConfig.model_validate(
            {**base.model_dump(), "selection_seed": config.seed, **cell_overrides(config, cell)}
        )
    )
    params = config.attack_params.get(cell.attack, {})
    crafted = set(attackers) if cell.attack in UPDATE_ATTACKS else set()
    clients = [i for i in range(config.clients) if i not in crafted]
    adversary = crafted_adversary(config, cell, co, crafted, params)
    client_app = make_simulated_client_app(
        shards=shards_for(config),
        clients=clients,
        misbehaviour={
            i: Misbehaviour(cell.attack, dict(params), seed=config.seed + i)
            for i in attackers
            if i not in crafted
        },
        seed=config.seed,
        workdir=home / "clients",
        registry=co.registry.root,
        coordinator_key=co.signer.public_key,
    )
    summaries: list[RoundSummary] = []
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        routes = register_nodes(grid, co, expected=len(clients))
        sim_grid = SimulationGrid(
            grid, co.backend, routes=routes, spool=home / "spool", adversary=adversary
        )
        run_rounds(co, sim_grid, on_round=summaries.append)

    run_simulation(
        server_app,
        client_app,
        num_supernodes=len(clients),
        backend_config=ray_backend_config(config.jobs),
    )
    bad = {node_identity(config.seed, i).contributor_id for i in attackers}
    return summaries, co, bad


def crafted_adversary(
    config: SweepConfig,
    cell: Cell,
    co: Coordinator,
    crafted: set[int],
    params: dict[str, float],
) -> Adversary | None:
    """The colluding attackers whose updates are computed on the coordinator's side, each
    registered under its own key; None when the cell's attack is not such an update attack."""
    keys = {i: node_identity(config.seed, i) for i in sorted(crafted)}
    virtual = {register(co.backend, key, f"client-{i}"): key for i, key in keys.items()}
    if not virtual:
        return None
    return Adversary(cell.attack, virtual, f=config.tolerated, seed=config.seed, params=params)


def ray_backend_config(jobs: int) -> dict[str, Any]:
    """Flower's Ray backend on this machine: one CPU per ClientApp, `jobs` CPUs in all, the node
    known by 127.0.0.1, no dashboard. (Ray 2.55's GCS, raylet and workers still listen on every
    interface; it has no setting that keeps them on loopback.)"""
    return {
        "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
        "init_args": {
            "num_cpus": jobs,
            "include_dashboard": False,
            "logging_level": "error",
            "log_to_driver": False,
            "_node_ip_address": "127.0.0.1",
        },
    }
