"""Read deadlines and connection shares of the REST server (uvicorn, in this process, on
127.0.0.1): a connection that trickles its head is closed, a trickled body is answered 408, and
an address holding its share of connections is refused more, while others are served.

The deadline is 1 s here so the test is quick; test_rest_attacks.py checks the default (slow).
The share is 4 connections per address (default 64) so the test needs few sockets.
"""

from __future__ import annotations

import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from hostile_rest import client, trickle

from zoo_gym.coordinator.api.app import RestServer
from zoo_gym.coordinator.config import load_config
from zoo_gym.coordinator.serve import api_services
from zoo_gym.coordinator.service import Coordinator
from zoo_gym.simulation.demo import free_port

SHARE = 4


@pytest.fixture(scope="module")
def rest(tiny_home_template: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    home = tmp_path_factory.mktemp("deadlines") / "coordinator"
    shutil.copytree(tiny_home_template, home)  # a coordinator opens (makes) its ledger there
    config = load_config(home / "coordinator.toml")
    limits = {"api_read_timeout_s": 1.0, "api_max_connections_per_address": SHARE}
    co = Coordinator(config.model_copy(update=limits))
    port = free_port()
    server = RestServer(api_services(co), f"127.0.0.1:{port}")
    server.start(wait_s=10)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()
        co.engine.dispose()


def test_a_trickled_head_is_closed_at_the_deadline(rest: str) -> None:
    took, answer = trickle(rest, every_s=0.2, give_up_s=15)

    assert answer.status is None  # closed without an answer
    assert 0.9 < took < 6
    assert httpx.get(f"{rest}/health", timeout=5).status_code == 200


def test_a_trickled_body_is_408(rest: str) -> None:
    took, answer = trickle(rest, body=True, every_s=0.2, give_up_s=15)

    assert answer.status == 408
    assert answer.headers.get("connection") == "close"
    assert 0.9 < took < 6


def test_keep_alive_requests_are_served_past_the_deadline(rest: str) -> None:
    with httpx.Client(base_url=rest, timeout=5) as http:
        first = http.get("/health")
        time.sleep(1.5)  # longer than the deadline: an idle kept-alive connection may close
        second = http.get("/health")
    assert first.status_code == second.status_code == 200


def test_an_address_holding_its_share_is_refused_more_and_others_served(rest: str) -> None:
    host, port = rest.removeprefix("http://").split(":")
    held = [socket.create_connection((host, int(port)), timeout=5) for _ in range(SHARE)]
    try:
        for sock in held:  # answered, so counted (and kept alive, well within the deadline)
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: rest\r\n\r\n")
            assert sock.recv(4096).startswith(b"HTTP/1.1 200 ")
        with httpx.Client(base_url=rest, timeout=5) as same:
            refused = same.get("/health")
        with client(rest, source="127.0.0.2", timeout=5) as other:
            served = other.get("/health")
    finally:
        for sock in held:
            sock.close()

    assert refused.status_code == 503
    assert refused.text.startswith("too many connections from your address (4 open")
    assert served.status_code == 200
