"""Model manifests: what a published base version is, signed by the coordinator.

A version directory holds the model files (safetensors, config, tokenizer) and
`manifest.json` + `manifest.sig`. The manifest lists every file with its size
and SHA-256, so a contributor verifies each download against a signature made
with the coordinator key it pinned at registration. Sharded weights are files like
any other: the index and every shard are listed and hashed.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from zoo_gym.core.hashing import canonical_json, sha256_file
from zoo_gym.core.identity import Identity, verify
from zoo_gym.core.weights import INDEX

MANIFEST_FORMAT = 1
MANIFEST = "manifest.json"
SIGNATURE = "manifest.sig"


class ManifestError(ValueError):
    """A manifest is malformed, unsigned, or does not match the files."""


def plain_file_name(name: str) -> bool:
    """Whether `name` names a file directly inside a version directory (no path, not hidden)."""
    return bool(name) and "/" not in name and "\\" not in name and not name.startswith(".")


@dataclass(frozen=True)
class FileEntry:
    sha256: str
    size: int


@dataclass(frozen=True)
class ModelManifest:
    version: str
    parent: str | None
    round: int
    files: dict[str, FileEntry]
    aggregator: str = ""
    contributors: tuple[str, ...] = ()
    metrics: dict[str, float] = field(default_factory=dict)
    epsilon: float | None = None
    created_at: float = 0.0
    format: int = MANIFEST_FORMAT

    def to_bytes(self) -> bytes:
        body = asdict(self)
        body["contributors"] = list(self.contributors)
        return canonical_json(body)

    @classmethod
    def from_bytes(cls, data: bytes) -> ModelManifest:
        try:
            body: dict[str, Any] = json.loads(data)
            if body.get("format") != MANIFEST_FORMAT:
                raise ManifestError(f"manifest format {body.get('format')!r} is not supported")
            files = {name: FileEntry(**entry) for name, entry in body.pop("files").items()}
            for name in files:
                if not plain_file_name(name):
                    raise ManifestError(f"manifest names {name!r}, which is not a plain file name")
            body["contributors"] = tuple(body.get("contributors", ()))
            return cls(files=files, **body)
        except (ValueError, TypeError, KeyError) as exc:
            if isinstance(exc, ManifestError):
                raise
            raise ManifestError(f"manifest is malformed ({exc})") from None


def build_manifest(directory: Path, **fields: Any) -> ModelManifest:
    """Describe every file in `directory` (except the manifest itself)."""
    files = {
        p.name: FileEntry(sha256=sha256_file(p), size=p.stat().st_size)
        for p in sorted(directory.iterdir())
        if p.is_file() and p.name not in (MANIFEST, SIGNATURE)
    }
    return ModelManifest(files=files, created_at=time.time(), **fields)


def write_signed(directory: Path, manifest: ModelManifest, signer: Identity) -> None:
    data = manifest.to_bytes()
    (directory / MANIFEST).write_bytes(data)
    (directory / SIGNATURE).write_bytes(signer.sign(data))


def read_verified(directory: Path, coordinator_key: bytes) -> ModelManifest:
    """Load the manifest of `directory`, check its signature and every file hash.

    A weights file (safetensors or the shard index) that the manifest does not list is refused
    too: a loader would read it, and nothing vouches for it.
    """
    data = (directory / MANIFEST).read_bytes()
    if not verify(coordinator_key, (directory / SIGNATURE).read_bytes(), data):
        raise ManifestError(f"{directory / MANIFEST}: signature does not match the coordinator key")
    manifest = ModelManifest.from_bytes(data)
    for name, entry in manifest.files.items():
        path = directory / name
        if not path.exists() or sha256_file(path) != entry.sha256:
            raise ManifestError(f"{path}: missing or its SHA-256 differs from the manifest")
    for path in sorted(directory.iterdir()):
        weights = path.name == INDEX or path.name.endswith(".safetensors")
        if weights and path.name not in manifest.files:
            raise ManifestError(f"{path}: a weights file the manifest does not list; remove it")
    return manifest
