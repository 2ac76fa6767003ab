"""The same sweep cell on Flower's simulation engine (Ray): same ServerApp, same ClientApp."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from netns import isolated

from zoo_gym.simulation.experiment import make_template, run_cell, run_sweep
from zoo_gym.simulation.inprocess import node_identity
from zoo_gym.simulation.sweep import Cell, SweepConfig, SweepError, load_sweep

pytest.importorskip("ray", reason="Flower's simulation engine needs the `sim` extra (ray)")


@pytest.mark.timeout(450)
def test_ray_engine_runs_the_round_loop_with_a_data_attacker_and_a_crafted_one(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if not isolated(request, timeout=420):  # Ray listens on every interface: there, only lo
        return
    # Prepare: 5 clients; under label_flip attacker 1 is a Ray node, under sign_flip it is crafted
    config = SweepConfig(
        aggregators=["median"],
        attacks=["label_flip", "sign_flip"],
        byzantine_shares=[0.2],
        clients=5,
        rounds=1,
        steps=3,
        examples_per_client=20,
        engine="ray",
        jobs=2,
        warmup_rounds=0,
    )
    template = make_template(tmp_path, config)

    # Execute
    poisoned = run_cell(config, Cell("median", "label_flip", 0.2), template, tmp_path)
    crafted = run_cell(config, Cell("median", "sign_flip", 0.2), template, tmp_path)

    # Assert: both rounds ran through intake and aggregation, and the model improved
    for result in (poisoned, crafted):
        assert result.published == 1 and result.byzantine_clients == 1
        assert result.losses[1] < result.losses[0]
    # the ledger holds five submissions per round, every one accepted at intake
    from sqlmodel import Session

    from zoo_gym import ledger
    from zoo_gym.coordinator.config import load_config

    for name in ("median-label_flip-20", "median-sign_flip-20"):
        home = tmp_path / "cells" / name
        engine = ledger.open_database(load_config(home / "coordinator.toml").ledger_url)
        with Session(engine) as session:
            subs = ledger.list_submissions(session)
        engine.dispose()
        assert len(subs) == 5 and {s.decision for s in subs} == {"accepted"}


@pytest.mark.timeout(450)
def test_a_sweep_attached_to_a_two_node_cluster_runs_its_cells_on_both_nodes(
    tmp_path: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not isolated(request, timeout=420):  # Ray listens on every interface: there, only lo
        return
    from ray.cluster_utils import Cluster

    # Prepare: a head and a worker node, one CPU each, both on 127.0.0.1; contributor state
    # in files under a storage path (here one directory both nodes see)
    loopback = {"num_cpus": 1, "node_ip_address": "127.0.0.1"}
    cluster = Cluster(initialize_head=True, head_node_args={**loopback, "include_dashboard": False})
    nodes = {cluster.head_node.node_id, cluster.add_node(**loopback).node_id}
    monkeypatch.setenv("RAY_ADDRESS", cluster.address)  # what `--ray-address auto` reads first
    storage = tmp_path / "shared"
    storage.mkdir()
    config = SweepConfig(
        aggregators=["median"],
        attacks=["label_flip"],
        byzantine_shares=[0.25],
        clients=4,
        rounds=2,
        steps=2,
        examples_per_client=12,
        engine="ray",
        jobs=2,
        warmup_rounds=0,
        ray_address="auto",
        storage=storage,
    )

    # Execute: both cells (no attack, label flip) at once, attached to the cluster
    try:
        results = run_sweep(config, tmp_path / "work")
    finally:
        cluster.shutdown()

    # Assert: each cell ran both rounds with its 4 contributors (1 a label flipper at 25%)
    assert [(r.attack, r.published, r.byzantine_clients) for r in results] == [
        ("none", 2, 0),
        ("label_flip", 2, 1),
    ]
    trained: dict[str, set[str]] = {}
    for cell in ("median-none-00", "median-label_flip-25"):
        home = tmp_path / "work" / "cells" / cell
        rows = json.loads((home / "engine_nodes.json").read_text())
        assert sorted((r["round"], r["contributor_id"]) for r in rows) == sorted(
            (n, node_identity(config.seed, i).contributor_id) for n in (1, 2) for i in range(4)
        )
        trained[cell] = {r["ray_node_id"] for r in rows}
        assert not (home / "clients").exists()  # contributors keep nothing in the driver's homes
    # the cluster's two nodes both trained contributors; the run's state directory is gone
    assert set().union(*trained.values()) == nodes
    assert list(storage.iterdir()) == []


def test_an_address_where_no_cluster_answers_is_one_line_before_any_work(tmp_path: Path) -> None:
    # Prepare: nothing listens on port 9 of this machine
    from typer.testing import CliRunner

    from zoo_gym.cli.sim import app

    args = ["run", "--engine", "ray", "--ray-address", "127.0.0.1:9", "--aggregators", "median"]

    # Execute
    result = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "out")])

    # Assert: one line saying what to do, and no warm-up was run
    assert result.exit_code == 1
    assert "error: no Ray cluster answers at" in result.output
    assert "ray start --head" in result.output
    assert not (tmp_path / "out" / "work").exists()


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"ray_address": "auto"}, 'ray_address and storage need engine = "ray"'),
        ({"engine": "ray", "ray_address": "head-node"}, "ray_address must be auto or host:port"),
    ],
)
def test_ray_settings_are_checked_with_the_sweep(settings: dict[str, str], message: str) -> None:
    with pytest.raises(SweepError, match=message):
        load_sweep(None, settings)
