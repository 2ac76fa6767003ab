"""Model files stream with the manifest's SHA-256; nothing outside a version is served."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import pytest

from zoo_gym.core.identity import verify

if TYPE_CHECKING:
    from api_world import World


def test_versions_and_signed_manifest(shared_world: World) -> None:
    w = shared_world
    (model,) = w.client.get("/models", headers=w.as_viewer).json()
    manifest = w.client.get("/models/v0000/manifest", headers=w.as_viewer).json()
    data = (w.co.registry.root / "v0000" / "manifest.json").read_bytes()
    assert model["version"] == "v0000" and model["files"] == len(manifest["manifest"]["files"])
    assert (
        model["manifest_sha256"] == manifest["manifest_sha256"] == hashlib.sha256(data).hexdigest()
    )
    assert verify(w.co.signer.public_key, bytes.fromhex(manifest["signature"]), data)


def test_download_matches_the_manifest(shared_world: World) -> None:
    w = shared_world
    files = w.client.get("/models/v0000/manifest", headers=w.as_viewer).json()["manifest"]["files"]
    assert "model.safetensors" in files
    for name, entry in files.items():
        response = w.client.get(f"/models/v0000/files/{name}", headers=w.as_viewer)
        assert response.status_code == 200
        assert hashlib.sha256(response.content).hexdigest() == entry["sha256"]
        assert len(response.content) == entry["size"]
        assert response.headers["etag"] == f'"{entry["sha256"]}"'


@pytest.mark.parametrize(
    "path",
    [
        "/models/v0000/files/..%2F..%2Fcoordinator.key",
        "/models/v0000/files/%2E%2E",
        "/models/v0000/files/notes.txt",  # in the directory, not in the manifest
        "/models/v0000/files/manifest.sig",
        "/models/..%2Fv0000/files/config.json",
        "/models/%2E%2E/files/coordinator.key",
        "/models/v9999/files/config.json",
    ],
)
def test_download_refuses_anything_outside_the_manifest(shared_world: World, path: str) -> None:
    w = shared_world
    (w.co.registry.root / "v0000" / "notes.txt").write_text("not published")
    response = w.client.get(path, headers=w.as_viewer)
    assert response.status_code == 404
    assert b"PRIVATE KEY" not in response.content
