"""The virtual contributors of `--engine ray`: what runs in Ray actors, on any node of the cluster.

Flower's simulation engine runs the ClientApp in a pool of Ray actors; which actor serves
which virtual contributor changes from message to message, and the actors sit on whichever
nodes Ray placed them. So nothing a contributor needs lives on the driver's disk:

- the federation's `Setup` (data shards, which cell and client each engine node is, who
  misbehaves, the coordinator's key) is one object in Ray's object store, fetched once per
  actor;
- every model version a cell trains on is put into the object store once, by the driver; a
  `Shelf` actor maps "cell/version" to its reference. An actor writes a version's files once
  to its own scratch directory, verifies them against the coordinator's key, and keeps one
  model loaded between messages: the next contributor on the same version trains at once,
  one on another version (another round or cell) reloads the weights into the same model;
- each contributor's own state (error-feedback residual, privacy accounting) is restored
  before its round and stored back after it: in the object store through the `Shelf`
  (`ShelfStates`), or in files under a storage path every node reaches, such as a shared
  filesystem (`DirectoryStates`).

Each train reply also names the Ray node that trained it (`ENGINE` record), so the driver
can tell where its contributors ran.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import ray
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

from zoo_gym.client.byzantine import Misbehaviour
from zoo_gym.client.runtime import ClientRuntime
from zoo_gym.client.trainers.sft import Trainer
from zoo_gym.core.chat import to_conversation
from zoo_gym.core.manifest import read_verified
from zoo_gym.core.protocol import SignedRegistration
from zoo_gym.simulation.inprocess import node_identity

REGISTRATION = "registration"
LOCATION = "location"  # reply to a LOCATE query: the engine node's partition id
LOCATE = "locate"  # group id of the query that asks an engine node which seat it is
ENGINE = "engine"  # record of a train reply: the Ray node that trained it
STATE_FILES = ("state.json", "feedback.safetensors")  # a ClientRuntime's own state in its home


@dataclass(frozen=True)
class Seat:
    """What engine node (partition) p is: contributor `client` of the cell named `cell`."""

    cell: str
    client: int
    misbehaviour: Misbehaviour | None = None

    @property
    def key(self) -> str:
        return f"{self.cell}/client-{self.client}"


@dataclass(frozen=True)
class Setup:
    """Everything the ClientApp needs that does not change during the federation."""

    shards: list[list[dict[str, str]]]
    seats: list[Seat]  # by partition id
    seed: int
    coordinator_key: bytes


class Shelf:
    """Object references by name, so that an actor anywhere finds what the driver or another
    actor put into the object store: model versions ("cell/version") and contributor state
    ("state/cell/client-i"). Runs as a Ray actor without CPUs (`new_shelf`)."""

    def __init__(self) -> None:
        self.refs: dict[str, ray.ObjectRef[Any]] = {}

    def hold(self, key: str, refs: list[ray.ObjectRef[Any]]) -> None:
        """Keep `refs[0]` (put by the caller) under `key`; wrapped in a list, Ray passes the
        reference itself instead of its value."""
        self.refs[key] = refs[0]

    def put(self, key: str, value: Any) -> None:
        """Put `value` into the object store, owned by this actor, under `key`."""
        self.refs[key] = ray.put(value)

    def get(self, key: str) -> list[ray.ObjectRef[Any]]:
        """[the reference under `key`], or [] when there is none."""
        return [self.refs[key]] if key in self.refs else []

    def forget(self, key: str) -> None:
        """Let go of the reference under `key` (the object goes once no one else holds it)."""
        self.refs.pop(key, None)

    def drop(self, prefix: str) -> int:
        """Let go of every reference whose key starts with `prefix`; how many there were."""
        gone = [k for k in self.refs if k.startswith(prefix)]
        for key in gone:
            del self.refs[key]
        return len(gone)


def new_shelf() -> Any:
    """A `Shelf` actor (no CPUs: it only holds references) on the cluster `ray` is connected to."""
    return ray.remote(num_cpus=0)(Shelf).remote()


class StateStore(Protocol):
    """Where a contributor's own state lives between its rounds."""

    def restore(self, key: str, home: Path) -> None:
        """Write contributor `key`'s state files into `home` (nothing before its first round)."""

    def keep(self, key: str, home: Path) -> None:
        """Store the state files in `home` as contributor `key`'s."""


@dataclass(frozen=True)
class DirectoryStates:
    """State files under `root`/<cell>/client-<i>/; `root` must be reachable from every node."""

    root: Path

    def restore(self, key: str, home: Path) -> None:
        for name in STATE_FILES:
            if (self.root / key / name).exists():
                shutil.copyfile(self.root / key / name, home / name)

    def keep(self, key: str, home: Path) -> None:
        target = self.root / key
        target.mkdir(parents=True, exist_ok=True)
        for name in STATE_FILES:
            if (home / name).exists():  # whole or not at all: copy aside, then rename
                part = target / f".{name}.{os.getpid()}.part"
                shutil.copyfile(home / name, part)
                os.replace(part, target / name)


@dataclass(frozen=True)
class ShelfStates:
    """State files in Ray's object store, found through the `Shelf` actor `shelf`."""

    shelf: Any

    def restore(self, key: str, home: Path) -> None:
        refs = ray.get(self.shelf.get.remote(f"state/{key}"))
        files: dict[str, bytes] = ray.get(refs[0]) if refs else {}
        for name, data in files.items():
            (home / name).write_bytes(data)

    def keep(self, key: str, home: Path) -> None:
        files = {n: (home / n).read_bytes() for n in STATE_FILES if (home / n).exists()}
        ray.get(self.shelf.put.remote(f"state/{key}", files))


class ActorCache:
    """What one Ray actor keeps between the messages it serves: the setup, a scratch
    directory on its node, and one model (the trainer of the version it last loaded)."""

    def __init__(self) -> None:
        self.scratch = Path(tempfile.mkdtemp(prefix="zoo-gym-ray-"))
        weakref.finalize(self, shutil.rmtree, self.scratch, ignore_errors=True)
        self.setups: dict[str, Setup] = {}
        self.trainer: Trainer | None = None
        self.adapter = ""
        self.loaded: tuple[str, str] | None = None  # (cell, version) of the trainer's weights

    def setup(self, ref: ray.ObjectRef[Setup]) -> Setup:
        if ref.hex() not in self.setups:
            self.setups[ref.hex()] = ray.get(ref)
        return self.setups[ref.hex()]

    def train(
        self, setup: Setup, seat: Seat, message: Message, shelf: Any, states: StateStore
    ) -> Message:
        """Contributor `seat`'s round: its state restored, the cached model, its state kept."""
        home = self.scratch / "contributor"
        shutil.rmtree(home, ignore_errors=True)
        home.mkdir(parents=True)
        states.restore(seat.key, home)

        def source(version: str, directory: Path) -> None:
            self.fetch(shelf, seat.cell, version, directory, setup.coordinator_key)

        runtime = ClientRuntime(
            identity=node_identity(setup.seed, seat.client),
            conversations=[to_conversation(r) for r in setup.shards[seat.client]],
            home=home,
            model_source=source,
            misbehaviour=seat.misbehaviour,
        )
        runtime.trainer, runtime.adapter = self.trainer, self.adapter
        if self.loaded is not None and self.loaded[0] == seat.cell:
            runtime.base_version = self.loaded[1]  # same cell: a version it holds is not reloaded
        self.loaded = None  # until the round has loaded whole weights
        reply = runtime.train(message)
        self.trainer, self.adapter = runtime.trainer, runtime.adapter
        self.loaded = (seat.cell, runtime.base_version)
        states.keep(seat.key, home)
        return reply

    def fetch(self, shelf: Any, cell: str, version: str, directory: Path, key: bytes) -> None:
        """Link `directory` to `cell`'s `version`, written once per actor from the object
        store (the one version it keeps on disk), and check it against the coordinator `key`."""
        stored = self.scratch / "models" / cell / version
        if not stored.exists():
            refs = ray.get(shelf.get.remote(f"{cell}/{version}"))
            if not refs:
                raise RuntimeError(
                    f"model version {version} of cell {cell} is not in the object store"
                )
            files: dict[str, bytes] = ray.get(refs[0])
            shutil.rmtree(self.scratch / "models", ignore_errors=True)
            part = stored.with_name(version + ".part")
            part.mkdir(parents=True)
            for name, data in files.items():  # relative paths, as `version_files` reads them
                (part / name).parent.mkdir(parents=True, exist_ok=True)
                (part / name).write_bytes(data)
            part.rename(stored)
        directory.parent.mkdir(parents=True, exist_ok=True)
        directory.symlink_to(stored, target_is_directory=True)
        read_verified(directory, key)


_CACHE: ActorCache | None = None


def actor_cache() -> ActorCache:
    """This process's `ActorCache` (a Ray actor of Flower's pool serves many messages)."""
    global _CACHE
    if _CACHE is None:
        _CACHE = ActorCache()
    return _CACHE


def make_ray_client_app(
    *, setup: ray.ObjectRef[Setup], shelf: Any, states: StateStore
) -> ClientApp:
    """A ClientApp whose partition p is `setup`'s seat p (see the module docstring)."""
    app = ClientApp()

    def seat(context: Context) -> tuple[Setup, Seat]:
        partition = context.node_config["partition-id"]
        assert isinstance(partition, int), f"partition-id must be an int, got {partition!r}"
        known = actor_cache().setup(setup)
        return known, known.seats[partition]

    @app.query()
    def hello(message: Message, context: Context) -> Message:
        if message.metadata.group_id == LOCATE:
            record = ConfigRecord({"partition": context.node_config["partition-id"]})
            return Message(RecordDict({LOCATION: record}), reply_to=message)
        known, who = seat(context)
        registration = SignedRegistration.now(
            node_identity(known.seed, who.client), f"client-{who.client}", int(time.time() * 1000)
        )
        record = ConfigRecord(registration.to_record())
        return Message(RecordDict({REGISTRATION: record}), reply_to=message)

    @app.train()
    def train(message: Message, context: Context) -> Message:
        known, who = seat(context)
        reply = actor_cache().train(known, who, message, shelf, states)
        node = ray.get_runtime_context().get_node_id()
        reply.content[ENGINE] = ConfigRecord({"ray_node_id": node})
        return reply

    return app
