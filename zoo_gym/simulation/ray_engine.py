"""Sweep cells on Flower's simulation engine (Ray): the same ServerApp and ClientApp code.

Flower runs the virtual SuperNodes' ClientApps in Ray actors and hands our round loop its own
Grid. The driver either starts a local Ray with `jobs` CPUs or attaches to a running cluster
(`ray_address`: "auto" or host:port), and runs every cell of the sweep in ONE Flower
federation: its engine nodes are the cells' contributors, cell after cell, and the ServerApp
runs `jobs` cells' round loops at once, each over its own nodes. So the cells share one pool of
actors spread over the whole cluster. (Flower's Ray backend sizes its pool to every CPU of the
cluster and shuts Ray down when its run ends, so separate federations, one per cell, could not
share a cluster at the same time.)

What differs from deployment, handled here and in `ray_contributors`:

- identity: each virtual contributor's Ed25519 key is derived from the sweep seed and its
  client index, so whichever actor runs a node signs with the same key. When its cell starts,
  the coordinator sends each of the cell's nodes a query; the reply is a signed registration,
  which the coordinator's backend checks like a `Register` call.
- state: contributors keep nothing on the driver's disk. The driver puts each model version a
  cell trains on into Ray's object store once; contributor state lives in the object store or
  under `storage` (see `ray_contributors`).
- where: every train reply names the Ray node that trained it; each cell writes them to
  `engine_nodes.json` in its coordinator home, beside its ledger.

Byzantine contributors under an update attack are not engine nodes: `SimulationGrid`'s
adversary crafts their replies on the coordinator's side, as in-process.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import shutil
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flwr.app import Context, Message, MessageType, RecordDict
from flwr.serverapp import Grid, ServerApp

from zoo_gym.client.byzantine import Misbehaviour
from zoo_gym.coordinator.config import CoordinatorConfig, load_config
from zoo_gym.coordinator.rounds import RoundSummary, run_rounds
from zoo_gym.coordinator.service import Coordinator
from zoo_gym.core.identity import Identity
from zoo_gym.core.protocol import SUBMISSION, SignedRegistration, SignedSubmission
from zoo_gym.simulation.adversary import UPDATE_ATTACKS, Adversary
from zoo_gym.simulation.grid import SimulationGrid
from zoo_gym.simulation.inprocess import node_identity, register
from zoo_gym.simulation.ray_contributors import (
    ENGINE,
    LOCATE,
    LOCATION,
    REGISTRATION,
    DirectoryStates,
    Seat,
    Setup,
    ShelfStates,
    StateStore,
    make_ray_client_app,
    new_shelf,
)
from zoo_gym.simulation.sweep import (
    Cell,
    SweepConfig,
    SweepError,
    byzantine_indices,
    cell_overrides,
    shards_for,
)
from zoo_gym.transport.grid import RunGrid

log = logging.getLogger(__name__)
_OPENING = threading.Lock()  # cells start in threads; their coordinators open ledgers in turn


@dataclass(frozen=True)
class CellPlan:
    """One cell of the federation: its attackers, and its engine nodes (seats
    `first`..`first + len(clients) - 1`, one per contributor that trains)."""

    cell: Cell
    attackers: list[int]
    crafted: set[int]  # attackers whose updates the adversary crafts: no engine node
    clients: list[int]
    first: int


@dataclass
class CellRun:
    """A finished cell: its rounds, its coordinator, its attackers' contributor ids, and
    where each update was trained ((round, contributor id, Ray node id))."""

    cell: Cell
    summaries: list[RoundSummary]
    coordinator: Coordinator
    byzantine: set[str]
    trained_on: list[tuple[int, str, str]] = field(default_factory=list)
    seconds: float = 0.0


def run_on_ray(
    config: SweepConfig,
    cells: Sequence[Cell],
    *,
    template: Path,
    home_of: Callable[[Cell], Path],
    on_done: Callable[[CellRun], None],
) -> None:
    """Run `cells` in one Flower federation on Ray, `config.jobs` at a time; `home_of(cell)`
    makes a cell's fresh coordinator home, `on_done` sees each cell as it finishes."""
    import ray
    from flwr.simulation import run_simulation

    plans = plan_cells(config, cells)
    seats = [
        Seat(p.cell.name, i, misbehaviour(config, p.cell, i) if i in p.attackers else None)
        for p in plans
        for i in p.clients
    ]
    run_dir = storage_dir(config.storage) if config.storage else None
    connect(config)
    try:
        shelf = new_shelf()
        states: StateStore = DirectoryStates(run_dir) if run_dir else ShelfStates(shelf)
        setup = ray.put(Setup(shards_for(config), seats, config.seed, signer_key(template)))
        server_app = ServerApp()

        @server_app.main()
        def main(grid: Grid, context: Context) -> None:
            nodes = locate(grid, expected=len(seats))

            def run(plan: CellPlan) -> CellRun:
                mine = CellGrid(grid, nodes[plan.first : plan.first + len(plan.clients)])
                return run_planned(config, plan, home_of(plan.cell), mine, shelf)

            run_cells(plans, jobs=config.jobs, run=run, on_done=on_done)

        run_simulation(
            server_app,
            make_ray_client_app(setup=setup, shelf=shelf, states=states),
            num_supernodes=len(seats),
            backend_config=ray_backend_config(config.jobs, attach=config.ray_address is not None),
        )
    finally:
        ray.shutdown()
        if run_dir is not None:
            shutil.rmtree(run_dir, ignore_errors=True)


def plan_cells(config: SweepConfig, cells: Sequence[Cell]) -> list[CellPlan]:
    """Each cell's attackers and engine nodes, the cells' nodes one after another."""
    plans, first = [], 0
    for cell in cells:
        attackers = byzantine_indices(config, cell.share) if cell.attack != "none" else []
        crafted = set(attackers) if cell.attack in UPDATE_ATTACKS else set()
        clients = [i for i in range(config.clients) if i not in crafted]
        plans.append(CellPlan(cell, attackers, crafted, clients, first))
        first += len(clients)
    return plans


def misbehaviour(config: SweepConfig, cell: Cell, client: int) -> Misbehaviour:
    """How attacker `client` of `cell` misbehaves when it trains (a data attack)."""
    params = config.attack_params.get(cell.attack, {})
    return Misbehaviour(cell.attack, dict(params), seed=config.seed + client)


def run_cells(
    plans: Sequence[CellPlan],
    *,
    jobs: int,
    run: Callable[[CellPlan], CellRun],
    on_done: Callable[[CellRun], None],
) -> None:
    """`run` every plan, `jobs` at a time; the first failure stops those not yet started."""
    with concurrent.futures.ThreadPoolExecutor(jobs, thread_name_prefix="cell") as pool:
        futures = [pool.submit(run, plan) for plan in plans]
        try:
            for future in concurrent.futures.as_completed(futures):
                on_done(future.result())
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise


def run_planned(
    config: SweepConfig, plan: CellPlan, home: Path, grid: CellGrid, shelf: Any
) -> CellRun:
    """One cell's federation over its engine nodes: registration, then its rounds."""
    started = time.perf_counter()
    base = load_config(home / "coordinator.toml")
    settings = {**base.model_dump(), "selection_seed": config.seed}
    with _OPENING:  # alembic's migration context is one per process
        co = Coordinator(
            CoordinatorConfig.model_validate({**settings, **cell_overrides(config, plan.cell)})
        )
    adversary = crafted_adversary(config, plan.cell, co, plan.crafted)
    routes = register_nodes(grid, co, expected=len(plan.clients))
    shipped = ShippedVersions(plan.cell.name, co, shelf)
    shipped.ship(co.backend.current_version())
    summaries: list[RoundSummary] = []

    def on_round(summary: RoundSummary) -> None:
        summaries.append(summary)
        if summary.status == "published":
            shipped.ship(summary.published_version)

    sim_grid = SimulationGrid(
        grid, co.backend, routes=routes, spool=home / "spool", adversary=adversary
    )
    try:
        run_rounds(co, sim_grid, on_round=on_round)
    finally:
        shipped.drop()
    (home / "engine_nodes.json").write_text(
        json.dumps(
            [{"round": r, "contributor_id": c, "ray_node_id": n} for r, c, n in grid.trained_on]
        )
    )
    bad = {node_identity(config.seed, i).contributor_id for i in plan.attackers}
    return CellRun(
        plan.cell, summaries, co, bad, list(grid.trained_on), time.perf_counter() - started
    )


class ShippedVersions:
    """The model versions of one cell in Ray's object store: the current base, put once by
    the driver and found by actors through the `Shelf` as "cell/version"."""

    def __init__(self, cell: str, co: Coordinator, shelf: Any) -> None:
        self.cell, self.co, self.shelf = cell, co, shelf
        self.current = ""

    def ship(self, version: str) -> None:
        import ray

        files = version_files(self.co.registry.root / version)
        ray.get(self.shelf.hold.remote(f"{self.cell}/{version}", [ray.put(files)]))
        if self.current:  # rounds run one after another: the old base is done with
            ray.get(self.shelf.forget.remote(f"{self.cell}/{self.current}"))
        self.current = version

    def drop(self) -> None:
        """Let go of everything of this cell: its versions and its contributors' state."""
        import ray

        ray.get(self.shelf.drop.remote(f"{self.cell}/"))
        ray.get(self.shelf.drop.remote(f"state/{self.cell}/"))


def version_files(directory: Path) -> dict[str, bytes]:
    """Every file of a published version (manifest, signature, weights, tokenizer), by its
    path relative to `directory`."""
    return {
        p.relative_to(directory).as_posix(): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


class CellGrid(RunGrid):
    """One cell's view of the federation's Grid: only its engine nodes; each train reply's
    `ENGINE` record is taken off (the coordinator sees the reply as deployed) and noted."""

    def __init__(self, inner: Grid, nodes: Sequence[int]) -> None:
        super().__init__()
        self.inner = inner
        self.nodes = list(nodes)
        self.trained_on: list[tuple[int, str, str]] = []  # (round, contributor id, Ray node id)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.nodes)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self.inner.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return [self._noted(m) for m in self.inner.pull_messages(message_ids)]

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        return [self._noted(m) for m in self.inner.send_and_receive(messages, timeout=timeout)]

    def _noted(self, reply: Message) -> Message:
        if reply.has_error() or ENGINE not in reply.content.config_records:
            return reply
        node = str(reply.content.config_records[ENGINE]["ray_node_id"])
        del reply.content[ENGINE]
        sub = SignedSubmission.from_record(reply.content.config_records[SUBMISSION])
        self.trained_on.append((sub.round, sub.contributor_id, node))
        return reply


def locate(grid: Grid, *, expected: int, timeout_s: float = 600.0) -> list[int]:
    """The engine node id of every partition, in partition order (Flower numbers its nodes
    at random; each node's reply to a LOCATE query says which partition it is)."""
    nodes = wait_for_nodes(grid, expected, timeout_s)
    queries = [Message(RecordDict(), n, MessageType.QUERY, group_id=LOCATE) for n in nodes]
    found: dict[int, int] = {}
    for reply in grid.send_and_receive(queries, timeout=timeout_s):
        if reply.has_error():
            raise RuntimeError(f"node {reply.metadata.src_node_id} failed: {reply.error.reason}")
        partition = reply.content.config_records[LOCATION]["partition"]
        assert isinstance(partition, int)
        found[partition] = reply.metadata.src_node_id
    if sorted(found) != list(range(expected)):
        raise RuntimeError(f"{len(found)} of {expected} simulated nodes answered")
    return [found[p] for p in range(expected)]


def wait_for_nodes(grid: Grid, expected: int, timeout_s: float) -> list[int]:
    """The grid's node ids once all `expected` are up (the engine brings them up after the
    ServerApp starts)."""
    deadline = time.monotonic() + timeout_s
    nodes = list(grid.get_node_ids())
    while len(nodes) < expected:
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"{len(nodes)} of {expected} simulated nodes came up in {timeout_s:.0f} s"
            )
        time.sleep(0.2)
        nodes = list(grid.get_node_ids())
    return nodes


def register_nodes(
    grid: Grid, co: Coordinator, *, expected: int, timeout_s: float = 600.0
) -> dict[int, int]:
    """Ask every engine node for its signed registration; coordinator node id -> engine node id."""
    nodes = wait_for_nodes(grid, expected, timeout_s)
    queries = [Message(RecordDict(), n, MessageType.QUERY, group_id="register") for n in nodes]
    routes: dict[int, int] = {}
    for reply in grid.send_and_receive(queries, timeout=timeout_s):
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


def crafted_adversary(
    config: SweepConfig, cell: Cell, co: Coordinator, crafted: set[int]
) -> Adversary | None:
    """The colluding attackers whose updates are computed on the coordinator's side, each
    registered under its own key; None when the cell's attack is not such an update attack."""
    keys = {i: node_identity(config.seed, i) for i in sorted(crafted)}
    virtual = {register(co.backend, key, f"client-{i}"): key for i, key in keys.items()}
    if not virtual:
        return None
    params = config.attack_params.get(cell.attack, {})
    return Adversary(cell.attack, virtual, f=config.tolerated, seed=config.seed, params=params)


def signer_key(home: Path) -> bytes:
    """The public key the coordinator of `home` signs its model versions with."""
    config = load_config(home / "coordinator.toml")
    return Identity.load(config.path(config.signing_key)).public_key


def check_cluster(config: SweepConfig) -> None:
    """SweepError when `config.storage` is no directory or no Ray cluster answers at
    `config.ray_address`."""
    if config.storage is not None:
        check_storage(config.storage)
    if config.ray_address is not None:
        cluster_address(config.ray_address)


def check_storage(storage: Path) -> None:
    if not storage.is_dir():
        raise SweepError(
            f"storage directory {storage} does not exist; create it on a filesystem every Ray "
            "node mounts, or leave --storage out to keep contributor state in Ray's object store"
        )


def storage_dir(storage: Path) -> Path:
    """A fresh directory for this run's contributor state under `storage` (removed after it)."""
    check_storage(storage)
    run_dir = storage / f"zoo-gym-{uuid.uuid4().hex[:12]}"
    run_dir.mkdir()
    return run_dir


def cluster_address(address: str, timeout_s: float = 5.0) -> str:
    """host:port of the Ray cluster that `address` names ("auto": $RAY_ADDRESS or the cluster
    `ray start` last started on this machine), once its GCS port answers; SweepError when none
    does (ray.init would wait for it for minutes)."""
    from ray._private.services import canonicalize_bootstrap_address

    try:
        resolved = canonicalize_bootstrap_address(address)
    except (ConnectionError, ValueError) as exc:
        raise SweepError(f"no Ray cluster found for --ray-address {address} ({exc})") from None
    if resolved is None:
        raise SweepError(
            f"no Ray cluster found for --ray-address {address}; start one with `ray start --head`"
        )
    host, _, port = resolved.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except OSError as exc:
        where = resolved if resolved == address else f"{address} ({resolved})"  # Ray's resolution
        raise SweepError(
            f"no Ray cluster answers at {where}: {exc.strerror or exc}; start one with "
            "`ray start --head` or pass the address `ray status` shows as --ray-address"
        ) from None
    return resolved


def connect(config: SweepConfig) -> None:
    """Attach to the cluster at `config.ray_address`, or start a local Ray with `jobs` CPUs."""
    import ray

    if config.ray_address is None:
        init_args = ray_backend_config(config.jobs)["init_args"]
        # as Flower's backend does: Ray's workers import what this process imports
        pythonpath = os.pathsep.join([*sys.path, *filter(None, [os.environ.get("PYTHONPATH")])])
        ray.init(runtime_env={"env_vars": {"PYTHONPATH": pythonpath}}, **init_args)
        return
    address = cluster_address(config.ray_address)  # checked again: the sweep's warm-up took time
    ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False)
    log.info("attached to the Ray cluster at %s", address)


def ray_backend_config(jobs: int, *, attach: bool = False) -> dict[str, Any]:
    """Flower's Ray backend: one CPU per ClientApp. Attached to a cluster, Flower's pool takes
    every CPU of the cluster; otherwise Ray starts on this machine with `jobs` CPUs, the node
    known by 127.0.0.1, no dashboard. (Ray 2.55's GCS, raylet and workers still listen on every
    interface; it has no setting that keeps them on loopback.)"""
    resources = {"num_cpus": 1, "num_gpus": 0.0}
    if attach:
        return {"client_resources": resources, "init_args": {}}
    return {
        "client_resources": resources,
        "init_args": {
            "num_cpus": jobs,
            "include_dashboard": False,
            "logging_level": "error",
            "log_to_driver": False,
            "_node_ip_address": "127.0.0.1",
        },
    }
