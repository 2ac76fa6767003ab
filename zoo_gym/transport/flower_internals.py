"""Every use of Flower's internals in zoo-gym, in one place.

Checked against flwr 1.41.0 (pyproject pins `flwr>=1.41,<1.42`); re-read each one when the pin
moves. zoo-gym runs Flower's ServerApp and ClientApps over Grids of its own (gRPC, loopback,
simulation) and outside Flower's runners, which Flower's public API does not fully cover:

- A Grid gives each message it pushes an id. `Metadata.message_id` is a read-only property over
  `Metadata.__dict__["_message_id"]`, with no public setter; Flower's own `InMemoryGrid`
  (flwr/superlink/grid/inmemory_grid.py) and SuperLink state assign it by writing that entry,
  and so does `assign_message_id`.
- `Message(...)` takes its run id, source node id and task id from the process-wide
  `flwr.supercore.task_identity.TaskIdentity`, which Flower's runners set before a ServerApp or
  ClientApp runs (flwr/superlink/runtime/run_serverapp.py, flwr/server/compat/app.py). A
  ServerApp that zoo-gym runs itself sets them with `set_task_identity`.
- The public `flwr.serverapp.Grid` interface types its `run` with `flwr.supercore.run.Run`
  (flwr/serverapp/grid/grid.py), which Flower exports from no public module; zoo-gym's Grids take
  `Run` from here.
"""

from __future__ import annotations

import uuid

from flwr.app import Message
from flwr.supercore.run import Run as Run
from flwr.supercore.task_identity import TaskIdentity


def assign_message_id(message: Message, message_id: str | None = None) -> str:
    """Give `message` the id a Grid assigns when it pushes it (a fresh one by default)."""
    assigned = message_id or uuid.uuid4().hex
    message.metadata.__dict__["_message_id"] = assigned
    return assigned


def set_task_identity(*, run_id: int, node_id: int, task_id: int) -> None:
    """Set the run, node and task that the `Message`s this process builds are from."""
    TaskIdentity.run_id = run_id
    TaskIdentity.node_id = node_id
    TaskIdentity.task_id = task_id
