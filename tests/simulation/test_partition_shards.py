"""What a sweep's `task` and `partition` give its clients and its coordinator."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from typer.testing import CliRunner

from zoo_gym.cli.sim import app
from zoo_gym.core.synthetic import make_examples, operation_of, shard, sum_bucket
from zoo_gym.simulation.experiment import make_template
from zoo_gym.simulation.sweep import (
    SweepConfig,
    SweepError,
    load_sweep,
    shards_for,
    validation_records,
)


def _config(**fields: object) -> SweepConfig:
    return SweepConfig.model_validate({"aggregators": ["fedavg"], **fields})


def test_iid_addition_is_the_round_robin_it_always_was() -> None:
    config = _config(clients=7, examples_per_client=10, seed=3)

    assert shards_for(config) == shard(make_examples(70, seed=4), 7)


def test_label_partition_gives_every_client_one_operation() -> None:
    config = _config(
        clients=100, task="arithmetic", partition="labels", classes_per_client=1, seed=0
    )

    shards = shards_for(config)

    classes = [Counter(operation_of(r) for r in s) for s in shards]
    assert all(len(c) == 1 and sum(c.values()) == 60 for c in classes)
    # 100 shards over 4 equally likely operations: 25 clients each
    assert sorted(Counter(next(iter(c)) for c in classes).values()) == [25, 25, 25, 25]
    assert shards == shards_for(config)


def test_label_partition_with_two_classes_splits_each_client_in_halves() -> None:
    config = _config(clients=20, task="arithmetic", partition="labels", classes_per_client=2)

    for s in shards_for(config):
        counts = Counter(operation_of(r) for r in s)
        assert sorted(counts.values()) in ([30, 30], [60])


def test_dirichlet_partition_of_addition_skews_answer_buckets_per_client() -> None:
    skewed = shards_for(_config(clients=30, partition="dirichlet", alpha=0.05, seed=1))
    near_iid = shards_for(_config(clients=30, partition="dirichlet", alpha=1000.0, seed=1))

    def top_share(s: list[dict[str, str]]) -> float:
        return max(Counter(sum_bucket(r) for r in s).values()) / len(s)

    assert all(len(s) == 60 for s in skewed + near_iid)
    # the largest bucket (40-49) holds 20% of IID sums; Dir(0.05 * p) puts most of a client there
    assert sum(top_share(s) for s in skewed) / 30 > 0.8
    assert sum(top_share(s) for s in near_iid) / 30 < 0.3
    assert skewed != shards_for(_config(clients=30, partition="dirichlet", alpha=0.05, seed=2))


def test_validation_covers_every_operation_whatever_the_partition() -> None:
    config = _config(task="arithmetic", partition="labels")

    records = validation_records(config)

    assert records is not None
    assert Counter(operation_of(r) for r in records) == {0: 50, 1: 50, 2: 50, 3: 50}
    assert validation_records(_config()) is None  # addition keeps the tiny home's split


def test_template_holds_the_tasks_validation_and_one_home_per_partition(tmp_path: Path) -> None:
    config = _config(
        clients=4,
        examples_per_client=8,
        task="arithmetic",
        partition="labels",
        warmup_rounds=1,
        steps=2,
        engine="batched",
    )

    template = make_template(tmp_path, config)
    other = make_template(tmp_path, config.model_copy(update={"classes_per_client": 2}))

    lines = (template / "validation.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == validation_records(config)
    assert (template / "models" / "v0001").is_dir()  # the warm-up round published
    assert other != template and make_template(tmp_path, config) == template


def test_bad_partitions_get_one_line() -> None:
    with pytest.raises(SweepError, match="arithmetic task has 4 classes; set classes_per_client"):
        load_sweep(None, {"task": "arithmetic", "partition": "labels", "classes_per_client": 5})
    with pytest.raises(SweepError, match="partition: Input should be 'iid', 'dirichlet' or"):
        load_sweep(None, {"partition": "zipf"})
    with pytest.raises(SweepError, match="alpha: Input should be greater than 0"):
        load_sweep(None, {"partition": "dirichlet", "alpha": 0.0})


def test_run_flags_reach_the_sweep() -> None:
    result = CliRunner().invoke(
        app, ["run", "--task", "algebra", "--partition", "labels", "--classes-per-client", "2"]
    )

    assert result.exit_code != 0
    assert "task: Input should be 'addition' or 'arithmetic'" in result.output
