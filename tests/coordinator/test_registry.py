"""Model versions on disk: a sharded base is taken as it is, and versions publish in shards."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from typer.testing import CliRunner

from zoo_gym.cli.coordinator import app
from zoo_gym.coordinator.config import load_config
from zoo_gym.coordinator.registry import ModelRegistry
from zoo_gym.core.identity import Identity
from zoo_gym.core.manifest import MANIFEST, SIGNATURE, read_verified
from zoo_gym.core.weights import INDEX, WEIGHTS, load_weights, shard_files, weight_files


def _same(left: dict[str, torch.Tensor], right: dict[str, torch.Tensor]) -> bool:
    return left.keys() == right.keys() and all(torch.equal(left[k], right[k]) for k in left)


def test_init_accepts_a_sharded_base_model(
    sharded_base: Path, tiny_home_template: Path, tmp_path: Path
) -> None:
    # Prepare
    home = tmp_path / "coordinator"
    validation = tiny_home_template / "validation.jsonl"
    args = ["--base-model", str(sharded_base), "--validation", str(validation)]

    # Execute
    result = CliRunner().invoke(app, ["init", "--home", str(home), *args])

    # Assert: v0000 is the index and its shards, each listed and hashed in the signed manifest
    assert result.exit_code == 0, result.output
    v0000 = home / "models" / "v0000"
    files = weight_files(v0000)
    assert files[0] == INDEX and len(files) > 3 and not (v0000 / WEIGHTS).exists()
    signer = Identity.load(home / "coordinator.key")
    manifest = read_verified(v0000, signer.public_key)
    on_disk = {p.name for p in v0000.iterdir()} - {MANIFEST, SIGNATURE}
    assert set(manifest.files) == on_disk and set(files) <= on_disk
    registry = ModelRegistry(home / "models", signer)
    assert _same(registry.load_state_dict("v0000"), load_weights(sharded_base))


def test_init_refuses_a_base_with_a_missing_shard_in_one_line(
    sharded_base: Path, tiny_home_template: Path, tmp_path: Path
) -> None:
    # Prepare
    base = tmp_path / "base"
    shutil.copytree(sharded_base, base)
    shard_files(base)[1].unlink()
    home = tmp_path / "coordinator"
    validation = tiny_home_template / "validation.jsonl"

    # Execute
    result = CliRunner().invoke(
        app,
        ["init", "--home", str(home), "--base-model", str(base), "--validation", str(validation)],
    )

    # Assert
    assert result.exit_code == 1
    assert result.output.startswith("error: ") and result.output.count("\n") == 1
    assert "model-00002-of-" in result.output and "which is not in" in result.output
    assert not (home / "coordinator.toml").exists() and not (home / "models").exists()


def test_a_published_version_is_written_in_shards_of_shard_size(sharded_home: Path) -> None:
    # Prepare
    config = load_config(sharded_home / "coordinator.toml")
    registry = ModelRegistry(
        sharded_home / "models", Identity.load(sharded_home / "coordinator.key")
    )
    state = {k: v + 0.25 for k, v in registry.load_state_dict("v0000").items()}
    fields = {"round_number": 1, "aggregator": "fedavg", "contributors": (), "metrics": {}}

    # Execute: v0001 in shards of the configured size, v0002 in one file
    sharded = registry.publish(state, parent="v0000", shard_size=config.shard_size, **fields)
    single = registry.publish(state, parent="v0001", shard_size=10**9, **fields)

    # Assert
    shards = shard_files(sharded.directory)
    assert config.shard_size == 100_000 and len(shards) > 3
    assert all(p.stat().st_size <= config.shard_size + 4096 for p in shards)  # plus the header
    assert set(sharded.manifest.files) == {p.name for p in sharded.directory.iterdir()} - {
        MANIFEST,
        SIGNATURE,
    }
    assert registry.verify("v0001") == sharded.manifest
    assert _same(registry.load_state_dict("v0001"), state)
    # the parent's shards and index are weights, not files to carry over
    assert sorted(p.name for p in single.directory.glob("model*")) == [WEIGHTS]
    assert {"config.json", "tokenizer.json"} <= set(single.manifest.files)
    assert _same(registry.load_state_dict("v0002"), state)
