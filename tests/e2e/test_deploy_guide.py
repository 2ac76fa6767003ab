"""The README's deployment guide, step by step, as far as it runs on one machine.

`gym-coordinator init --tls` for localhost / 127.0.0.1, `serve` as a real process, REST over HTTPS
checked against the CA (health, an admin call with a key from `apikey create`, /metrics), one
contributor refused without the CA, then joining over TLS with `--ca-cert` and finishing a round,
its reward statement over HTTPS, then `tls renew` with both ports switching to the new certificate
without a restart. Every process is stopped by PID. (Another CA being refused
is in tests/coordinator/test_tls.py.)
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from prometheus_client.parser import text_string_to_metric_families
from tls_probe import file_sha256, served_sha256

from zoo_gym.core.synthetic import make_examples, write_jsonl
from zoo_gym.simulation.demo import free_port

pytestmark = pytest.mark.e2e


def _cli(
    tool: str, *args: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", f"zoo_gym.cli.{tool}", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "COLUMNS": "200", **(env or {})},
    )


@contextlib.contextmanager
def _process(argv: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as out:
        proc = subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        try:
            yield proc
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()


def _wait_healthy(
    url: str, ca: Path, proc: subprocess.Popen[bytes], log: Path
) -> dict[str, object]:
    deadline = time.monotonic() + 90
    context = ssl.create_default_context(cafile=str(ca))
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        with contextlib.suppress(httpx.TransportError):
            answer = httpx.get(f"{url}/health", verify=context, timeout=5)
            if answer.status_code == 200:
                body: dict[str, object] = answer.json()
                return body
        time.sleep(0.3)
    raise TimeoutError(f"no /health at {url}: {log.read_text()[-3000:]}")


def test_tls_coordinator_from_the_guide(tmp_path: Path) -> None:
    port, rest_port = free_port(), free_port()
    home = tmp_path / "coordinator"
    api = f"https://localhost:{rest_port}"

    # Step 1: init with TLS material for the names contributors dial
    made = _cli(
        "coordinator",
        "init",
        "--home",
        str(home),
        "--tiny",
        "--tls",
        "--host",
        "localhost",
        "--host",
        "127.0.0.1",
        "--listen",
        f"127.0.0.1:{port}",
        "--rest-listen",
        f"127.0.0.1:{rest_port}",
    )
    assert made.returncode == 0, made.stderr
    ca = home / "tls" / "ca.pem"
    der = x509.load_pem_x509_certificate(ca.read_bytes()).public_bytes(serialization.Encoding.DER)
    fingerprint = hashlib.sha256(der).hexdigest().upper()
    printed = re.search(r"fingerprint: ([0-9A-F:]{95})", made.stdout)
    assert printed is not None and printed.group(1).replace(":", "") == fingerprint
    assert f"gym-client join localhost:{port} --ca-cert ca.pem" in made.stdout
    config = (home / "coordinator.toml").read_text()
    assert 'tls_cert = "tls/server.pem"' in config and 'tls_key = "tls/server.key"' in config

    # a short federation for the test: one round, one contributor, few steps
    config = config.replace("rounds = 0", "rounds = 1").replace(
        "min_clients = 2", "min_clients = 1"
    )
    # and the certificate files checked every second (60 by default) for the renewal step
    config = "tls_reload_s = 1\n" + config
    (home / "coordinator.toml").write_text(config.replace("steps = 30", "steps = 4"))

    # Step 2: serve (gRPC and REST both over TLS)
    serve_argv = [
        sys.executable,
        "-m",
        "zoo_gym.cli.coordinator",
        "serve",
        "-c",
        str(home / "coordinator.toml"),
        "--stay",
    ]
    with _process(serve_argv, tmp_path / "coordinator.log") as coordinator:
        health = _wait_healthy(api, ca, coordinator, tmp_path / "coordinator.log")
        assert health["status"] == "ok" and health["model_version"] == "v0000"

        # plain HTTP and HTTPS without the CA are refused
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx.get(f"{api}/health", timeout=5)
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://127.0.0.1:{rest_port}/health", timeout=5)

        # Step 3: an admin key, used over HTTPS by `gym-coordinator admin --ca-cert`
        issued = _cli(
            "coordinator",
            "apikey",
            "create",
            "--role",
            "admin",
            "--name",
            "ops",
            "-c",
            str(home / "coordinator.toml"),
            "--format",
            "json",
        )
        assert issued.returncode == 0, issued.stderr
        token = json.loads(issued.stdout)["token"]
        listed = _cli(
            "coordinator",
            "admin",
            "--url",
            api,
            "--token",
            token,
            "--ca-cert",
            str(ca),
            "contributors",
            "list",
            "--format",
            "json",
        )
        assert listed.returncode == 0, listed.stderr
        assert json.loads(listed.stdout) == []

        # Step 4: a contributor. Without the CA the TLS handshake fails: one line, exit 1
        alice = tmp_path / "alice"
        assert _cli("client", "init", "--home", str(alice), "--name", "alice").returncode == 0
        write_jsonl(make_examples(40, seed=2), alice / "data.jsonl")
        join = [
            "join",
            f"localhost:{port}",
            "--home",
            str(alice),
            "--data",
            str(alice / "data.jsonl"),
            "--max-rounds",
            "1",
        ]
        refused = _cli("client", *join, timeout=60)
        assert refused.returncode == 1, refused.stdout + refused.stderr
        # one line of ours (gRPC's C core may log the failed handshake on a line of its own)
        errors = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "Traceback" not in refused.stderr, refused.stderr
        assert errors[0].startswith(f"error: cannot reach the coordinator at localhost:{port}")

        # ... with the CA it joins, trains, submits
        (alice / "ca.pem").write_bytes(ca.read_bytes())
        joined = _cli("client", *join, "--ca-cert", str(alice / "ca.pem"), timeout=240)
        assert joined.returncode == 0, joined.stdout + joined.stderr
        assert "left after 1 submission(s)" in joined.stdout

        deadline = time.monotonic() + 120
        while not (home / "rounds.jsonl").exists() and time.monotonic() < deadline:
            time.sleep(0.3)
        rounds = [json.loads(line) for line in (home / "rounds.jsonl").read_text().splitlines()]
        assert [r["round"] for r in rounds] == [1]
        assert rounds[0]["status"] in ("published", "rolled_back")

        # the operator sees it over HTTPS: the contributor, and the round in /metrics
        headers = {"Authorization": f"Bearer {token}"}
        context = ssl.create_default_context(cafile=str(ca))
        people = httpx.get(
            f"{api}/contributors", headers=headers, verify=context, timeout=10
        ).json()
        assert [p["name"] for p in people] == ["alice"]
        metrics = httpx.get(f"{api}/metrics", headers=headers, verify=context, timeout=10).text
        assert "zoo_gym_submissions_accepted_total 1.0" in metrics
        served = x509.load_pem_x509_certificate((home / "tls" / "server.pem").read_bytes())
        [expiry] = [
            sample.value
            for family in text_string_to_metric_families(metrics)
            for sample in family.samples
            if sample.name == "zoo_gym_tls_certificate_expiry_timestamp_seconds"
        ]
        assert expiry == served.not_valid_after_utc.timestamp()  # what the expiry alert watches

        # the contributor's reward statement over HTTPS, checked with ca_cert from client.toml
        with (alice / "client.toml").open("a") as fh:
            fh.write('ca_cert = "ca.pem"\n')
        statement = _cli(
            "client", "rewards", "--home", str(alice), "--api", api, "--format", "json", "--verify"
        )
        assert statement.returncode == 0, statement.stderr
        assert [r["round"] for r in json.loads(statement.stdout)["rounds"]] == [1]

        # Step 10: renew the certificate; both ports serve it without a restart
        old = served_sha256(rest_port, ca)
        renewed = _cli("coordinator", "tls", "renew", "-c", str(home / "coordinator.toml"))
        assert renewed.returncode == 0, renewed.stderr
        assert f"CA unchanged (SHA-256 {printed.group(1)})" in renewed.stdout
        new = file_sha256(home / "tls" / "server.pem")
        assert new != old
        deadline = time.monotonic() + 30
        while {served_sha256(rest_port, ca), served_sha256(port, ca, alpn="h2")} != {new}:
            assert time.monotonic() < deadline, "the renewed certificate was not picked up"
            time.sleep(0.3)
        again = _cli("client", "rewards", "--home", str(alice), "--api", api, "--verify")
        assert again.returncode == 0, again.stderr  # contributors changed nothing

        # Step 5: stop it like systemd does (SIGTERM to the PID)
        os.killpg(coordinator.pid, signal.SIGTERM)
        assert coordinator.wait(timeout=30) == 0
