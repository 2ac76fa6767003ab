"""The batched engine: many virtual contributors training together on one shared model.

It must train each contributor as the per-contributor path does (same losses, same
aggregate, same published model) and run a round of 1,000 of them within 2 GB (its time
against the 20 s goal is measured by bench/simulation.py, not asserted here).
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
from flwr.app import Message

from zoo_gym.core.protocol import TRAIN_METRICS
from zoo_gym.core.weights import load_weights
from zoo_gym.simulation.batched import BatchedEngineError, BatchedFederation, check_task
from zoo_gym.simulation.experiment import make_template, run_sweep
from zoo_gym.simulation.inprocess import InProcessFederation
from zoo_gym.simulation.sweep import Cell, SweepConfig, cell_overrides, shards_for

ROOT = Path(__file__).resolve().parents[2]


def _record_losses(fed: InProcessFederation | BatchedFederation) -> dict[int, list[float]]:
    """Node -> the train_loss each of its replies reported, round by round, as the ServerApp
    sees them (intake forwards the contributor's training metrics)."""
    losses: dict[int, list[float]] = {}
    inner = fed.grid.send_and_receive

    def send_and_receive(messages: Iterable[Message], *, timeout: float | None = None) -> Any:
        batch = list(messages)
        replies = list(inner(batch, timeout=timeout))
        for request, reply in zip(batch, replies, strict=True):
            loss = reply.content.metric_records[TRAIN_METRICS]["train_loss"]
            assert isinstance(loss, float)
            losses.setdefault(request.metadata.dst_node_id, []).append(loss)
        return replies

    fed.grid.send_and_receive = send_and_receive  # type: ignore[method-assign]
    return losses


@pytest.mark.parametrize(("codec", "attack"), [("none", "none"), ("bitdelta", "label_flip")])
def test_batched_trains_each_contributor_as_the_per_contributor_path(
    tmp_path: Path, codec: str, attack: str
) -> None:
    # Prepare: 4 contributors (one poisoning its records under label_flip), 2 rounds of FedAvg
    config = SweepConfig(
        aggregators=["fedavg"],
        attacks=["label_flip"],
        byzantine_shares=[0.25],
        clients=4,
        rounds=2,
        warmup_rounds=0,
        steps=4,
        examples_per_client=24,
        codec=codec,
        f=0,
    )
    template = make_template(tmp_path, config)
    overrides = cell_overrides(config, Cell("fedavg", attack, 0.25))
    attackers = [1] if attack != "none" else []
    runs = {}
    for name, federation in (("inprocess", InProcessFederation), ("batched", BatchedFederation)):
        home = tmp_path / name
        shutil.copytree(template, home)
        fed = federation.build(
            home, shards_for(config), overrides=overrides, byzantine=attackers, attack=attack
        )
        losses = _record_losses(fed)
        order = list(
            fed.runtimes if isinstance(fed, InProcessFederation) else fed.clients.contributors
        )

        # Execute
        summaries = fed.run()
        weights = [
            load_weights(fed.coordinator.registry.root / s.published_version) for s in summaries
        ]
        runs[name] = ([losses[n] for n in order], summaries, weights)

    # Assert: every contributor's two round losses, every round's validation loss and both
    # published models agree up to float rounding (the batched engine pads to the group's
    # widest batch and takes logits at the labelled positions only)
    (own_losses, own_rounds, own_weights), (losses, rounds, weights) = runs.values()
    assert len(losses) == 4 and all(len(per) == 2 for per in losses)
    for expected, got in zip(own_losses, losses, strict=True):
        assert got == pytest.approx(expected, rel=1e-5)
    assert [s.status for s in rounds] == ["published", "published"]
    kept = tmp_path / "batched" / "batched" / "models"  # one copy of the base for all of them
    assert [p.name for p in kept.iterdir()] == [rounds[1].base_version] != [rounds[0].base_version]
    for expected_round, got_round in zip(own_rounds, rounds, strict=True):
        assert got_round.accepted == expected_round.accepted == 4
        assert got_round.loss_after == pytest.approx(expected_round.loss_after, rel=1e-5)
    base = load_weights(template / "base")
    for expected_state, state in zip(own_weights, weights, strict=True):
        for key, tensor in expected_state.items():
            torch.testing.assert_close(state[key], tensor, rtol=0, atol=2e-5)
        assert any(not torch.equal(t, base[k]) for k, t in state.items())  # the round moved it


def test_a_round_of_50_batched_contributors_under_attack(tmp_path: Path) -> None:
    # Prepare: 50 contributors, 5 of them colluding (ALIE, crafted from the honest updates)
    config = SweepConfig(
        aggregators=["trimmed_mean"],
        attacks=["alie"],
        byzantine_shares=[0.1],
        clients=50,
        rounds=1,
        warmup_rounds=0,
        steps=4,
        examples_per_client=16,
        engine="batched",
    )

    # Execute
    results = run_sweep(config, tmp_path / "work")

    # Assert: both cells ran their round on all 50 and the model learned in the baseline
    baseline, attacked = results
    assert (baseline.attack, attacked.attack, attacked.byzantine_clients) == ("none", "alie", 5)
    assert baseline.published == attacked.published == 1
    assert baseline.losses[1] < baseline.losses[0] - 0.2
    assert math.isfinite(attacked.losses[1]) and 0.0 <= attacked.byzantine_selected <= 1.0
    cells = tmp_path / "work" / "cells"
    assert (cells / Cell("trimmed_mean", "none", 0.0).name / "batched").is_dir()
    assert not list(cells.glob("*/clients"))  # no contributor keeps a model of its own


def test_batched_engine_refuses_what_it_cannot_train_in_one_line() -> None:
    from zoo_gym.core.protocol import TaskConfig

    with pytest.raises(BatchedEngineError, match="asks for method grpo, DP-SGD; the batched"):
        check_task(
            TaskConfig(round=3, base_version="v1", seed=1, method="grpo", dp_noise_multiplier=1.0)
        )


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_batched_losses_equal_each_contributors_merged_model(arch: str) -> None:
    # Prepare: 3 contributors with random Bs (rank 4), 2 rows each, right-padded, labels on
    # the last tokens of each row (one padding row without labels: a short batch)
    import copy

    from zoo_gym.core.chat import IGNORE_INDEX
    from zoo_gym.core.lora import LoraSpec
    from zoo_gym.core.tiny import build_tiny_model
    from zoo_gym.simulation.batched_training import BatchedFfaLora

    model = build_tiny_model(vocab_size=64, arch=arch, seed=3)
    reference = copy.deepcopy(model)
    spec = LoraSpec(rank=4, alpha=8)
    batched = BatchedFfaLora(model, spec=spec, pad_id=0)
    g, gen = 3, torch.Generator().manual_seed(7)
    for layer in batched.layers.values():
        layer.a = torch.randn(4, layer.base.in_features, generator=gen)
        layer.b = torch.randn(g, layer.base.out_features, 4, generator=gen) * 0.5
    lengths = [[9, 6], [12, 12], [7, 0]]  # contributor 2's second row is padding
    ids = torch.zeros(6, 12, dtype=torch.long)
    labels = torch.full((6, 12), IGNORE_INDEX)
    for row, n in enumerate(n for pair in lengths for n in pair):
        ids[row, :n] = torch.randint(1, 64, (n,), generator=gen)
        labels[row, max(n - 3, 0) : n] = ids[row, max(n - 3, 0) : n]

    # Execute
    with torch.no_grad():
        losses = batched._losses(ids, labels, g)

    # Assert: each contributor's loss is the token-mean NLL of its rows under the base with
    # W + s * B_c A merged into every target layer, run by the model's own forward
    for c in range(g):
        merged = copy.deepcopy(reference)
        for name, layer in batched.layers.items():
            weight = merged.get_submodule(name).weight
            weight.data += spec.scaling * layer.b[c] @ layer.a
        rows = slice(2 * c, 2 * c + 2)
        mask = (torch.arange(12) < torch.tensor(lengths[c]).unsqueeze(1)).long()
        with torch.no_grad():
            logits = merged(input_ids=ids[rows], attention_mask=mask).logits
        nll = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, 64), labels[rows, 1:].reshape(-1), ignore_index=IGNORE_INDEX
        )
        assert float(losses[c]) == pytest.approx(float(nll), rel=1e-5)


ROUND_SCRIPT = """
    import json, resource, shutil, sys, time
    from pathlib import Path
    from zoo_gym.simulation.batched import BatchedFederation
    from zoo_gym.simulation.experiment import make_template
    from zoo_gym.simulation.sweep import Cell, SweepConfig, cell_overrides, shards_for

    work = Path(sys.argv[1])
    config = SweepConfig(aggregators=["fedavg"], attacks=["alie"], byzantine_shares=[0.1],
                         clients=1000, rounds=1, warmup_rounds=0, f=0, engine="batched")
    home = work / "cell"
    shutil.copytree(make_template(work, config), home)
    fed = BatchedFederation.build(home, shards_for(config),
                                  overrides=cell_overrides(config, Cell("fedavg", "none", 0.0)))
    started = time.perf_counter()
    summary, = fed.run()
    print(json.dumps({"seconds": time.perf_counter() - started, "accepted": summary.accepted,
                      "status": summary.status,
                      "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


@pytest.mark.slow
def test_a_round_of_1000_batched_contributors_within_2_gb(tmp_path: Path) -> None:
    # Execute: one round of 1,000 contributors in a fresh process (its peak RSS is the round's)
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(ROUND_SCRIPT), str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
    )
    outcome = json.loads(done.stdout.strip().splitlines()[-1])

    # Assert
    assert outcome["status"] == "published" and outcome["accepted"] == 1000
    assert outcome["rss_mb"] < 2048, outcome
