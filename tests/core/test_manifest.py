"""Signed manifests cover sharded weights: every shard and the index, nothing unlisted."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from zoo_gym.core.identity import Identity
from zoo_gym.core.manifest import (
    ManifestError,
    ModelManifest,
    build_manifest,
    read_verified,
    write_signed,
)
from zoo_gym.core.weights import INDEX, WEIGHTS, save_weights


@pytest.fixture
def signed(tmp_path: Path) -> tuple[Path, Identity]:
    """A version directory: a config, weights in three shards and an index, signed."""
    signer = Identity.generate()
    state = {f"layer{i}": torch.full((4,), float(i)) for i in range(6)}  # 16 bytes each
    (tmp_path / "config.json").write_text("{}")
    save_weights(state, tmp_path, shard_size=32)
    write_signed(
        tmp_path, build_manifest(tmp_path, version="v0001", parent="v0000", round=1), signer
    )
    return tmp_path, signer


def test_the_manifest_lists_every_shard_and_the_index(signed: tuple[Path, Identity]) -> None:
    directory, signer = signed

    manifest = read_verified(directory, signer.public_key)

    shards = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert set(manifest.files) == {"config.json", INDEX, *shards}
    assert all(manifest.files[n].size == (directory / n).stat().st_size for n in manifest.files)


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: _flip_last_byte(d / "model-00002-of-00003.safetensors"), "SHA-256 differs"),
        (lambda d: (d / "model-00003-of-00003.safetensors").unlink(), "missing"),
        (lambda d: (d / INDEX).write_text('{"weight_map": {}}'), "SHA-256 differs"),
        (lambda d: (d / WEIGHTS).write_bytes(b"planted"), "the manifest does not list"),
        (lambda d: (d / "model-00004-of-00004.safetensors").write_bytes(b""), "does not list"),
    ],
    ids=["tampered shard", "missing shard", "tampered index", "unlisted file", "unlisted shard"],
)
def test_a_changed_missing_or_unlisted_weights_file_is_refused(
    signed: tuple[Path, Identity], change: Callable[[Path], object], message: str
) -> None:
    directory, signer = signed
    change(directory)

    with pytest.raises(ManifestError, match=message) as exc:
        read_verified(directory, signer.public_key)
    assert "\n" not in str(exc.value)


@pytest.mark.parametrize("name", ["../evil", "sub/model.safetensors", "C:\\x", ".hidden", ""])
def test_a_manifest_naming_anything_but_a_plain_file_is_refused(name: str) -> None:
    body = (
        b'{"aggregator":"","contributors":[],"created_at":0,"epsilon":null,"files":{"'
        + name.replace("\\", "\\\\").encode()
        + b'":{"sha256":"00","size":1}},"format":1,"metrics":{},"parent":null,"round":0,'
        b'"version":"v0001"}'
    )

    with pytest.raises(ManifestError, match="not a plain file name"):
        ModelManifest.from_bytes(body)
