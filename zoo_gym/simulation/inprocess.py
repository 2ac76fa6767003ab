"""A federation in one process: the coordinator's ServerApp and N ClientApps on the loopback Grid.

The coordinator, intake, ledger, aggregation and the clients' training are the
deployment code; only the wire is replaced by function calls. Used by tests
and by sweeps that need many rounds quickly.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flwr.app import Context, Message, RecordDict

from zoo_gym.client.app import make_client_app
from zoo_gym.client.runtime import ClientRuntime
from zoo_gym.coordinator.config import CoordinatorConfig, load_config
from zoo_gym.coordinator.rounds import RoundSummary
from zoo_gym.coordinator.service import Coordinator
from zoo_gym.core.chat import to_conversation
from zoo_gym.core.identity import Identity
from zoo_gym.core.manifest import read_verified
from zoo_gym.core.protocol import register_statement
from zoo_gym.transport.loopback import LoopbackGrid


@dataclass
class InProcessFederation:
    coordinator: Coordinator
    runtimes: dict[int, ClientRuntime]
    grid: LoopbackGrid
    summaries: list[RoundSummary] = field(default_factory=list)

    @classmethod
    def build(
        cls,
        home: Path,
        shards: list[list[dict[str, str]]],
        *,
        overrides: dict[str, Any] | None = None,
        tamper: Callable[[int, Message], Message] | None = None,
    ) -> InProcessFederation:
        config = load_config(home / "coordinator.toml")
        config = CoordinatorConfig.model_validate({**config.model_dump(), **(overrides or {})})
        co = Coordinator(config)
        signer_key = co.signer.public_key

        def source(version: str, directory: Path) -> None:
            if not directory.exists():
                shutil.copytree(co.registry.root / version, directory)
            read_verified(directory, signer_key)

        runtimes: dict[int, ClientRuntime] = {}
        nodes = {}
        for i, records in enumerate(shards):
            identity = Identity.generate()
            ts = int(time.time() * 1000)
            reg = co.backend.register(
                public_key=identity.public_key, name=f"client-{i}", timestamp_ms=ts,
                signature=identity.sign(register_statement(identity.public_key, f"client-{i}", ts)),
            )
            runtime = ClientRuntime(
                identity=identity, conversations=[to_conversation(r) for r in records],
                home=home / "clients" / f"client-{i}", model_source=source,
            )
            runtimes[reg.node_id] = runtime
            context = Context(run_id=1, node_id=reg.node_id, node_config={}, state=RecordDict(), run_config={})
            nodes[reg.node_id] = (make_client_app(runtime), context)
        grid = LoopbackGrid(co.backend, nodes, spool=home / "spool", tamper=tamper)
        return cls(co, runtimes, grid)

    def run(self) -> list[RoundSummary]:
        self.coordinator.run(self.grid, on_round=self.summaries.append)
        return self.summaries
