"""Fixtures: a coordinator's REST API on 127.0.0.1 (see `cli_server`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from cli_server import Served, free_port, populate

from zoo_gym.coordinator.api.app import RestServer
from zoo_gym.coordinator.config import load_config
from zoo_gym.coordinator.serve import api_services
from zoo_gym.coordinator.service import Coordinator


@pytest.fixture
def served(tiny_home: Path) -> Iterator[Served]:
    co = Coordinator(load_config(tiny_home / "coordinator.toml"))
    alice, admin, viewer = populate(co)
    port = free_port()
    server = RestServer(api_services(co), f"127.0.0.1:{port}")
    server.start(wait_s=10)
    try:
        yield Served(tiny_home, co, f"http://127.0.0.1:{port}", admin, viewer, alice)
    finally:
        server.stop()
        co.engine.dispose()
