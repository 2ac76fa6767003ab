"""Model download over real gRPC on 127.0.0.1: verified, resumed, repaired."""

from __future__ import annotations

from pathlib import Path

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
