"""Model download over real gRPC on 127.0.0.1: verified, resumed, repaired."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from zoo_gym.coordinator.config import load_config
from zoo_gym.coordinator.service import Coordinator
from zoo_gym.core.hashing import sha256_file
from zoo_gym.core.identity import Identity
from zoo_gym.core.manifest import read_verified
from zoo_gym.transport.client import FederationClient
from zoo_gym.transport.mailbox import Mailbox
from zoo_gym.transport.server import start_server


def test_fetch_model_verifies_resumes_and_repairs(tiny_home: Path, tmp_path: Path) -> None:
    # Prepare
    co = Coordinator(load_config(tiny_home / "coordinator.toml"))
    server = start_server(co.backend, Mailbox(), address="127.0.0.1:0", spool=tmp_path / "spool")
    client = FederationClient(f"127.0.0.1:{server.port}", Identity.generate())
    try:
        key = client.register("downloader").coordinator_key
        dest = tmp_path / "v0000"
        weights = dest / "model.safetensors"
        expected = sha256_file(co.registry.root / "v0000" / "model.safetensors")

        # Execute + Assert: a fresh download matches the signed manifest
        manifest = client.fetch_model("v0000", dest, key)
        assert manifest.version == "v0000"
        read_verified(dest, co.signer.public_key)

        # a corrupt file of the right size is replaced
        size = weights.stat().st_size
        weights.write_bytes(b"\0" * size)
        client.fetch_model("v0000", dest, key)
        assert sha256_file(weights) == expected

        # a partial file is resumed from where it stopped
        data = weights.read_bytes()
        weights.write_bytes(data[: size // 3])
        client.fetch_model("v0000", dest, key)
        assert sha256_file(weights) == expected
    finally:
        client.close()
        server.stop()


def test_a_sharded_version_downloads_file_by_file_and_resumes_a_shard(
    sharded_home: Path, tmp_path: Path
) -> None:
    # Prepare: v0000 is an index and several shards
    from zoo_gym.core.weights import INDEX, load_weights, shard_files

    co = Coordinator(load_config(sharded_home / "coordinator.toml"))
    source = co.registry.root / "v0000"
    shards = shard_files(source)
    assert len(shards) > 3
    server = start_server(co.backend, Mailbox(), address="127.0.0.1:0", spool=tmp_path / "spool")
    client = FederationClient(f"127.0.0.1:{server.port}", Identity.generate())
    try:
        key = client.register("downloader").coordinator_key
        dest = tmp_path / "v0000"

        # Execute + Assert: every file of the manifest arrives and verifies
        manifest = client.fetch_model("v0000", dest, key)
        assert {INDEX, *(p.name for p in shards)} <= set(manifest.files)
        for name, entry in manifest.files.items():
            assert sha256_file(dest / name) == entry.sha256 == sha256_file(source / name)
        read_verified(dest, co.signer.public_key)

        # a shard cut short is resumed; one garbled at full size is fetched again; one deleted too
        middle, last, first = dest / shards[2].name, dest / shards[-1].name, dest / shards[0].name
        half = middle.stat().st_size // 2
        middle.write_bytes(middle.read_bytes()[:half])
        last.write_bytes(b"\0" * last.stat().st_size)
        first.unlink()
        requests: list[tuple[str, int]] = []
        download = client.stub.DownloadFile

        def recorded(request: Any, **kwargs: Any) -> Any:
            requests.append((request.file, request.offset))
            return download(request, **kwargs)

        client.stub.DownloadFile = recorded
        client.fetch_model("v0000", dest, key)
        assert sorted(requests) == sorted([(middle.name, half), (last.name, 0), (first.name, 0)])
        read_verified(dest, co.signer.public_key)
        state = load_weights(dest)
        assert all(torch.equal(state[k], v) for k, v in load_weights(source).items())

        # a weights file the manifest does not list (a loader would prefer it) is removed
        (dest / "model.safetensors").write_bytes(b"not signed by anyone")
        (dest / "notes.txt").write_text("left by someone")
        client.fetch_model("v0000", dest, key)
        assert not (dest / "model.safetensors").exists() and not (dest / "notes.txt").exists()
        read_verified(dest, co.signer.public_key)
    finally:
        client.close()
        server.stop()
        co.engine.dispose()
