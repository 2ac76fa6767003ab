from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from zoo_gym.cli.coordinator import app
from zoo_gym.coordinator.registry import ModelRegistry
from zoo_gym.coordinator.variants import (
    VariantError,
    apply_variant,
    calibration_ids,
    variant_paths,
    write_variant,
)
from zoo_gym.core.identity import Identity


def _publish_child(home: Path) -> ModelRegistry:
    registry = ModelRegistry(home / "models", Identity.load(home / "coordinator.key"))
    gen = torch.Generator().manual_seed(0)
    weights = {
        k: v + 0.01 * torch.randn(v.shape, generator=gen).to(v.dtype)
        for k, v in registry.load_state_dict("v0000").items()
    }
    registry.publish(
        weights, parent="v0000", round_number=1, aggregator="fedavg", contributors=(), metrics={}
    )
    return registry


def test_variant_round_trip_rebuilds_the_child_from_the_parent(tiny_home: Path) -> None:
    registry = _publish_child(tiny_home)
    parent, child = registry.load_state_dict("v0000"), registry.load_state_dict("v0001")

    record = write_variant(registry, "v0001")
    payload = variant_paths(registry.root, "v0001", "v0000")[0].read_bytes()
    rebuilt = apply_variant(parent, payload)

    values = sum(t.numel() for t in child.values())
    assert record.parent == "v0000" and not record.distilled
    assert 8 * record.size / values < 1.3  # 1.125 bits per weight, tails and the header
    for name, weight in child.items():
        delta, approx = (
            weight.float() - parent[name].float(),
            rebuilt[name].float() - parent[name].float(),
        )
        assert rebuilt[name].dtype == weight.dtype
        assert torch.equal(approx >= 0, delta >= 0)
        assert float((approx - delta).norm()) < float(delta.norm())  # 1-bit keeps most of it
    assert "variants" not in registry.versions()


def test_distilled_variant_is_recorded_and_applies(tiny_home: Path) -> None:
    registry = _publish_child(tiny_home)
    ids = calibration_ids(registry.root / "v0000", tiny_home / "validation.jsonl")
    plain = write_variant(registry, "v0001")

    record = write_variant(registry, "v0001", calibration=ids[:16], steps=5)

    payload = variant_paths(registry.root, "v0001", "v0000")[0].read_bytes()
    assert record.distilled and ids.shape[1] == 32
    assert (
        record.size == plain.size and record.sha256 != plain.sha256
    )  # the same signs, refit scales
    assert set(apply_variant(registry.load_state_dict("v0000"), payload)) == set(
        registry.load_state_dict("v0001")
    )


def test_the_first_version_has_no_variant(tiny_home: Path) -> None:
    registry = _publish_child(tiny_home)
    with pytest.raises(VariantError, match="first version"):
        write_variant(registry, "v0000")


def test_cli_writes_a_variant(tiny_home: Path) -> None:
    _publish_child(tiny_home)

    result = CliRunner().invoke(
        app, ["variant", "v0001", "-c", str(tiny_home / "coordinator.toml")]
    )
    missing = CliRunner().invoke(
        app, ["variant", "v0007", "-c", str(tiny_home / "coordinator.toml")]
    )

    assert result.exit_code == 0, result.output
    assert "variant v0001 from v0000" in result.output
    assert variant_paths(tiny_home / "models", "v0001", "v0000")[0].exists()
    assert missing.exit_code == 1 and "no published version v0007" in missing.output
