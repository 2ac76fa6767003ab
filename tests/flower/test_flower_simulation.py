"""A zoo_gym.flower strategy in a Flower ServerApp on Flower's simulation engine (Ray)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from netns import isolated

from zoo_gym.aggregation import krum, nnm

pytest.importorskip("ray", reason="Flower's simulation engine needs the `sim` extra (ray)")

CLIENTS, ROUNDS, F, M = 5, 2, 1, 3
Arrays = dict[str, np.ndarray]


def apps(marks: dict[str, Any]) -> tuple[Any, Any, Callable[[int, int, Arrays], Arrays]]:
    """A ServerApp running zoo_gym.flower.MultiKrum with NNM, a ClientApp whose node of
    partition 0 is an attacker (steps 1,000 times larger than the others'), and the function
    every node's arrays come from. Defined here so that Ray's workers receive them by value."""
    from flwr.app import (
        Array,
        ArrayRecord,
        ConfigRecord,
        Context,
        Message,
        MetricRecord,
        RecordDict,
    )
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp

    from zoo_gym.flower import MultiKrum

    def update(partition: int, server_round: int, base: Arrays) -> Arrays:
        rng = np.random.default_rng(100 * server_round + partition)
        scale = 50.0 if partition == 0 else 0.05
        return {k: (v + scale * rng.normal(size=v.shape)).astype(v.dtype) for k, v in base.items()}

    class Recorded(MultiKrum):
        """MultiKrum that notes the partitions of each round's replies, in arrival order."""

        def aggregate_train(self, server_round: int, replies: Any) -> Any:
            replies = list(replies)
            order = [int(msg.content["metrics"]["partition"]) for msg in replies]
            marks.setdefault("order", []).append(order)
            out = super().aggregate_train(server_round, replies)
            marks.setdefault("decisions", []).append(self.last_decisions)
            return out

    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        strategy = Recorded(
            num_malicious_nodes=F,
            num_nodes_to_select=M,
            nnm=True,
            fraction_evaluate=0.0,
            min_train_nodes=CLIENTS,
            min_available_nodes=CLIENTS,
        )
        result = strategy.start(
            grid=grid,
            initial_arrays=ArrayRecord(dict(marks["initial"])),
            num_rounds=ROUNDS,
            train_config=ConfigRecord({"lr": 0.1}),
        )
        marks["final"] = {k: a.numpy() for k, a in result.arrays.items()}

    client = ClientApp()

    @client.train()
    def train(msg: Message, context: Context) -> Message:
        partition = int(context.node_config["partition-id"])
        base = {k: a.numpy() for k, a in msg.content["arrays"].items()}
        server_round = int(msg.content["config"]["server-round"])
        arrays = ArrayRecord(
            {k: Array(v) for k, v in update(partition, server_round, base).items()}
        )
        metrics = MetricRecord({"num-examples": 8, "partition": partition})
        return Message(RecordDict({"arrays": arrays, "metrics": metrics}), reply_to=msg)

    return server, client, update


@pytest.mark.timeout(300)
def test_multikrum_with_nnm_on_ray_equals_the_rule(request: pytest.FixtureRequest) -> None:
    if not isolated(request, timeout=280):  # Ray listens on every interface: there, only lo
        return
    from flwr.app import Array
    from flwr.simulation import run_simulation

    from zoo_gym.simulation.ray_engine import ray_backend_config

    # Prepare: 5 nodes, one an attacker; 2 rounds of MultiKrum (f = 1, m = 3) with NNM
    rng = np.random.default_rng(7)
    initial = {
        "fc.weight": rng.normal(size=(4, 6)).astype(np.float32),
        "fc.bias": rng.normal(size=4).astype(np.float32),
    }
    marks: dict[str, Any] = {"initial": {k: Array(v) for k, v in initial.items()}}
    server, client, update = apps(marks)

    # Execute
    run_simulation(server, client, num_supernodes=CLIENTS, backend_config=ray_backend_config(2))

    # Assert: each round, zoo-gym's rule on the updates in the order they arrived, the
    # attacker never selected; the final global arrays bit for bit
    assert len(marks["order"]) == ROUNDS
    glob = initial
    for server_round, order in enumerate(marks["order"], start=1):
        sent = [update(p, server_round, glob) for p in order]
        x = torch.stack(
            [torch.cat([torch.from_numpy(s[k] - glob[k]).reshape(-1) for k in glob]) for s in sent]
        )  # (5, 28) float32
        agg = krum(nnm(x, f=F), f=F, m=M)
        chosen = [d.selected for _, d in marks["decisions"][server_round - 1]]
        assert chosen == [d.selected for d in agg.decisions]
        assert not chosen[order.index(0)]
        step = agg.vector.numpy()
        glob = {
            "fc.weight": glob["fc.weight"] + step[:24].reshape(4, 6),
            "fc.bias": glob["fc.bias"] + step[24:],
        }
    for key in initial:
        assert marks["final"][key].tobytes() == glob[key].tobytes(), key
