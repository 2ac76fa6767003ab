"""Published base models on disk: one directory per version, signed manifests.

`models/v0000` is the base the operator started from; each published round
adds the next version. A version directory is a normal Hugging Face model
directory (config, tokenizer, and `model.safetensors` or an index and its shards;
see `zoo_gym.core.weights`), so any tool loads it.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from zoo_gym.core.identity import Identity
from zoo_gym.core.manifest import (
    MANIFEST,
    SIGNATURE,
    ModelManifest,
    build_manifest,
    read_verified,
    write_signed,
)
from zoo_gym.core.weights import DEFAULT_SHARD_SIZE, load_weights, save_weights, weight_files


def version_name(index: int) -> str:
    return f"v{index:04d}"


VERSION_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # a version's directory name


@dataclass(frozen=True)
class Published:
    version: str
    directory: Path
    manifest: ModelManifest


class ModelRegistry:
    def __init__(self, root: Path, signer: Identity) -> None:
        self.root = root
        self.signer = signer
        root.mkdir(parents=True, exist_ok=True)

    def versions(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir() if (p / MANIFEST).exists())

    def latest(self) -> Published:
        versions = self.versions()
        if not versions:
            raise FileNotFoundError(
                f"no published model under {self.root}; run `gym-coordinator init`"
            )
        return self.get(versions[-1])

    def directory(self, version: str) -> Path:
        """The directory of published `version`; KeyError when there is none. `version` may come
        from the network: only a plain directory name is looked up, so no path leaves the root."""
        if not VERSION_NAME.fullmatch(version):
            raise KeyError(version)
        directory = self.root / version
        if not (directory / MANIFEST).exists():
            raise KeyError(version)
        return directory

    def get(self, version: str) -> Published:
        directory = self.directory(version)
        return Published(
            version, directory, ModelManifest.from_bytes((directory / MANIFEST).read_bytes())
        )

    def verify(self, version: str) -> ModelManifest:
        return read_verified(self.root / version, self.signer.public_key)

    def import_base(self, source: Path) -> Published:
        """Publish a Hugging Face model directory (safetensors weights, one file or shards) as
        v0000; `WeightsError` when its weights are missing or its index is inconsistent."""
        weight_files(source)  # checks the index before anything is copied
        target = self.root / version_name(0)
        shutil.copytree(source, target, dirs_exist_ok=True)
        manifest = build_manifest(target, version=version_name(0), parent=None, round=0)
        write_signed(target, manifest, self.signer)
        return Published(manifest.version, target, manifest)

    def load_state_dict(self, version: str) -> dict[str, torch.Tensor]:
        return load_weights(self.root / version)

    def publish(
        self,
        state_dict: dict[str, torch.Tensor],
        *,
        parent: str,
        round_number: int,
        aggregator: str,
        contributors: tuple[str, ...],
        metrics: dict[str, float],
        epsilon: float | None = None,
        shard_size: int = DEFAULT_SHARD_SIZE,
    ) -> Published:
        """Write the next version: parent's non-weight files + new weights (one file, or shards
        of at most `shard_size` bytes and their index) + signed manifest."""
        index = int(parent.removeprefix("v")) + 1
        version = version_name(index)
        staging = self.root / f".{version}.tmp"
        if staging.exists():
            shutil.rmtree(staging)
        staging.mkdir()
        source = self.root / parent
        skip = {*weight_files(source), MANIFEST, SIGNATURE}
        for item in source.iterdir():
            if item.is_file() and item.name not in skip:
                shutil.copy2(item, staging / item.name)
        save_weights(state_dict, staging, shard_size=shard_size)
        manifest = build_manifest(
            staging,
            version=version,
            parent=parent,
            round=round_number,
            aggregator=aggregator,
            contributors=contributors,
            metrics=metrics,
            epsilon=epsilon,
        )
        write_signed(staging, manifest, self.signer)
        target = self.root / version
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)  # a version appears whole or not at all
        return Published(version, target, manifest)
