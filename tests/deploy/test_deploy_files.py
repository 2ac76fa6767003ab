"""The files under deploy/ checked with the tools that run without a container engine.

- Dockerfiles: parsed here (known instructions, a non-root USER, pinned base images); every COPY
  source exists in the repository and is not excluded by .dockerignore.
- compose.yaml: parsed; every file it mounts exists; `docker-compose config` (Debian's
  docker-compose, no engine needed) or `docker compose config` when either is installed.
- Helm chart: `helm lint` is not run (no helm on Debian or PyPI); the chart is checked
  structurally: Chart.yaml fields, every `.Values.x.y` a template uses exists in values.yaml,
  every `include` names a defined template, balanced template actions.
- systemd units: `systemd-analyze verify` with ExecStart pointing at this tree's installed scripts.
- Prometheus: `promtool check config` (syntax, then the full check with the secret files present);
  the alerting rules with `promtool check rules`, on metrics the coordinator exports.
- Grafana: every metric a dashboard queries is one the coordinator exports; PromQL parsed by
  `promtool check rules`.
"""

from __future__ import annotations

import fnmatch
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
CHART = DEPLOY / "helm" / "zoo-gym-coordinator"
DOCKERFILES = sorted(DEPLOY.glob("*.Dockerfile"))
INSTRUCTIONS = {
    "FROM",
    "RUN",
    "CMD",
    "LABEL",
    "EXPOSE",
    "ENV",
    "ADD",
    "COPY",
    "ENTRYPOINT",
    "VOLUME",
    "USER",
    "WORKDIR",
    "ARG",
    "ONBUILD",
    "STOPSIGNAL",
    "HEALTHCHECK",
    "SHELL",
}


def _instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in dockerfile.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def _args(instructions: list[tuple[str, str]]) -> dict[str, str]:
    found: dict[str, str] = {}
    for word, rest in instructions:
        if word == "ARG" and "=" in rest:
            name, _, value = rest.partition("=")
            found[name] = value
    return found


def _dockerignore() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def _ignored(path: str, patterns: list[str]) -> bool:
    """Whether `path` (or a folder above it) matches a .dockerignore pattern (no `!` used here)."""
    parts = path.rstrip("/").split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pattern in patterns:
        assert not pattern.startswith("!"), "the test does not model exceptions"
        for prefix in prefixes:
            if fnmatch.fnmatchcase(prefix, pattern):
                return True
            if pattern.startswith("**/") and fnmatch.fnmatchcase(
                prefix.split("/")[-1], pattern[3:]
            ):
                return True
    return False


def test_there_are_two_dockerfiles() -> None:
    assert [d.name for d in DOCKERFILES] == ["client.Dockerfile", "coordinator.Dockerfile"]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_instructions(dockerfile: Path) -> None:
    instructions = _instructions(dockerfile)
    args = _args(instructions)

    assert {word for word, _ in instructions} <= INSTRUCTIONS
    # multi-stage: a build stage, then the image that runs
    stages = [rest for word, rest in instructions if word == "FROM"]
    assert len(stages) == 2 and stages[0].endswith(" AS build")
    for stage in stages:
        image = stage.split()[0]
        image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], image)
        assert ":" in image and not image.endswith(":latest"), image
    # the image that runs: non-root user, after which nothing runs as root
    final = instructions[max(i for i, (w, _) in enumerate(instructions) if w == "FROM") :]
    users = [rest for word, rest in final if word == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert [w for w, _ in final].index("USER") > max(
        i for i, (w, _) in enumerate(final) if w == "RUN"
    )
    assert any(word == "ENTRYPOINT" for word, _ in final)


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_every_copy_source_exists(dockerfile: Path) -> None:
    patterns = _dockerignore()
    copies = [rest for word, rest in _instructions(dockerfile) if word == "COPY"]
    from_context = [c.split()[:-1] for c in copies if not c.startswith("--from")]

    assert from_context
    for sources in from_context:
        for source in sources:
            assert (ROOT / source).exists(), f"{dockerfile.name}: COPY {source}: no such file"
            assert not _ignored(source.rstrip("/").removeprefix("./"), patterns), (
                f"{dockerfile.name}: COPY {source} is excluded by .dockerignore"
            )


def test_coordinator_image_facts() -> None:
    text = (DEPLOY / "coordinator.Dockerfile").read_text()
    assert "download.pytorch.org/whl/cpu" in text
    assert re.search(r"^EXPOSE 7443 8080$", text, re.MULTILINE)
    assert re.search(
        r"^HEALTHCHECK .*\n\s+CMD \[\"python\", \"/opt/zoo-gym/healthcheck.py\"\]",
        text,
        re.MULTILINE,
    )
    assert re.search(r'^VOLUME \["/var/lib/zoo-gym"\]$', text, re.MULTILINE)


def test_client_image_has_the_gpu_extra() -> None:
    import tomllib

    text = (DEPLOY / "client.Dockerfile").read_text()
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert re.search(r"nvidia/cuda:[\d.]+-cudnn-runtime-ubuntu", text)
    assert '".[gpu' in text
    for named in re.findall(r'"\.\[([a-z,-]+)\]"', text):  # pip only warns about an unknown extra
        assert set(named.split(",")) <= set(extras), f"client.Dockerfile installs .[{named}]"
    assert any(d.startswith("flash-attn") for d in extras["gpu"])
    assert any(d.startswith("bitsandbytes") for d in extras["gpu"])


def test_healthcheck_probe_against_a_real_server(tmp_path: Path) -> None:
    """deploy/healthcheck.py against a tiny HTTP server: exit 0 on "ok", 1 otherwise (a 503
    printing the reason it carries)."""
    import http.server
    import threading

    status = {"value": "ok"}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            ok = status["value"] == "ok"
            body = json.dumps({"status": status["value"], "reason": "round loop crashed"}).encode()
            self.send_response(200 if ok or status["value"] == "starting" else 503)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    env = {"ZOO_GYM_HEALTH_URL": f"http://127.0.0.1:{server.server_port}/health", "PATH": ""}
    try:
        probe = [sys.executable, str(DEPLOY / "healthcheck.py")]
        assert subprocess.run(probe, env=env, timeout=20).returncode == 0
        status["value"] = "starting"
        assert subprocess.run(probe, env=env, timeout=20).returncode == 1
        status["value"] = "unavailable"  # what a coordinator whose round loop ended answers
        down = subprocess.run(probe, env=env, timeout=20, capture_output=True, text=True)
        assert down.returncode == 1 and "503: round loop crashed" in down.stderr
    finally:
        server.shutdown()
    gone = subprocess.run(probe, env=env, timeout=20, capture_output=True, text=True)
    assert gone.returncode == 1 and gone.stderr.startswith("unhealthy:")


# --- compose --------------------------------------------------------------------------------------


def _compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    return data


def test_compose_services_and_files() -> None:
    compose = _compose()
    services = compose["services"]
    assert isinstance(services, dict)
    assert set(services) == {"coordinator", "postgres", "prometheus", "grafana"}
    assert services["coordinator"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert "healthcheck" in services["postgres"]
    assert services["coordinator"]["build"]["dockerfile"] == "deploy/coordinator.Dockerfile"
    assert (
        DEPLOY / services["coordinator"]["build"]["context"] / "deploy/coordinator.Dockerfile"
    ).exists()
    for name, service in services.items():
        image = service["image"]
        assert ":" in image and not image.endswith(":latest"), f"{name}: {image}"
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):  # bind mounts of this repository's files
                assert (DEPLOY / source).exists(), f"{name}: {source} does not exist"
    # the ledger URL (with its password) reaches the coordinator as a secret, not in its config
    coordinator = services["coordinator"]
    assert "database_url" in coordinator["secrets"]
    assert coordinator["environment"]["ZOO_GYM_DATABASE_URL_FILE"] == "/run/secrets/database_url"
    # secrets are files the operator creates (deploy/secrets/ is not in the repository)
    for secret in compose["secrets"].values():
        assert secret["file"].startswith("./secrets/")


def _compose_cli() -> list[str] | None:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True)
        if probe.returncode == 0:
            return ["docker", "compose"]
    return None


@pytest.mark.skipif(
    _compose_cli() is None,
    reason="no docker-compose and no docker CLI with the compose plugin installed "
    "(`apt-get install docker-compose` provides one; .ci/run installs it)",
)
def test_docker_compose_config() -> None:
    cli = _compose_cli()
    assert cli is not None
    result = subprocess.run(
        [*cli, "-f", str(DEPLOY / "compose.yaml"), "config"], capture_output=True, text=True
    )

    assert result.returncode == 0, result.stderr
    rendered = yaml.safe_load(result.stdout)
    assert set(rendered["services"]) == {"coordinator", "postgres", "prometheus", "grafana"}


# --- Helm -----------------------------------------------------------------------------------------


def _values_paths(values: object, prefix: str = "") -> set[str]:
    paths = {prefix} if prefix else set()
    if isinstance(values, dict):
        for key, value in values.items():
            paths |= _values_paths(value, f"{prefix}.{key}" if prefix else str(key))
    return paths


def test_chart_metadata() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())

    assert chart["apiVersion"] == "v2" and chart["name"] == "zoo-gym-coordinator"
    assert re.fullmatch(r"\d+\.\d+\.\d+", chart["version"])
    [postgres] = chart["dependencies"]
    assert postgres["name"] == "postgresql" and postgres["condition"] == "postgresql.enabled"
    assert postgres["repository"].startswith(("oci://", "https://"))
    templates = {p.name for p in (CHART / "templates").iterdir()}
    assert templates >= {
        "deployment.yaml",
        "service.yaml",
        "configmap.yaml",
        "pvc.yaml",
        "ingress.yaml",
        "NOTES.txt",
        "_helpers.tpl",
    }


def test_chart_templates_use_only_defined_values() -> None:
    values = _values_paths(yaml.safe_load((CHART / "values.yaml").read_text()))
    texts = {p.name: p.read_text() for p in (CHART / "templates").iterdir()}
    defined = set(re.findall(r'\{\{-?\s*define\s+"([^"]+)"', "".join(texts.values())))

    for name, text in texts.items():
        assert text.count("{{") == text.count("}}"), f"{name}: unbalanced template actions"
        for ref in re.findall(r"\.Values\.([A-Za-z0-9_.]+)", text):
            assert ref in values, f"{name}: .Values.{ref} is not in values.yaml"
        for used in re.findall(r'include\s+"([^"]+)"', text):
            assert used in defined, f"{name}: include {used!r} is not defined"
        opened = len(re.findall(r"\{\{-?\s*(?:if|with|range|define)\b", text))
        closed = len(re.findall(r"\{\{-?\s*end\b", text))
        assert opened == closed, f"{name}: {opened} blocks opened, {closed} closed"


def test_chart_runs_as_non_root_over_tls() -> None:
    deployment = (CHART / "templates" / "deployment.yaml").read_text()
    values = yaml.safe_load((CHART / "values.yaml").read_text())

    assert "runAsNonRoot: true" in deployment and "runAsUser: 10001" in deployment
    assert values["tls"]["enabled"] is True and values["postgresql"]["enabled"] is True
    assert values["image"]["tag"] != "latest"
    # the database URL is in the coordinator's environment, from a Secret, never written to a file
    helpers = (CHART / "templates" / "_helpers.tpl").read_text()
    serve = deployment[deployment.index("containers:") :]
    assert 'include "zoo-gym.databaseEnv"' in serve
    assert "- name: ZOO_GYM_DATABASE_URL" in helpers and "database_url" not in deployment


# --- systemd --------------------------------------------------------------------------------------

UNITS = sorted((DEPLOY / "systemd").glob("*.service"))


def _unit(path: Path) -> dict[str, dict[str, str]]:
    sections: dict[str, dict[str, str]] = {}
    current = ""
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            current = line.strip("[]")
            sections[current] = {}
        else:
            key, _, value = line.partition("=")
            sections[current][key] = value
    return sections


@pytest.mark.parametrize("unit", UNITS, ids=lambda p: p.name)
def test_unit_is_hardened(unit: Path) -> None:
    service = _unit(unit)["Service"]
    scripts = {"gym-coordinator", "gym-client", "gym-serve"}

    assert service["NoNewPrivileges"] == "yes" and service["ProtectSystem"] == "strict"
    assert service["Restart"] == "on-failure" and service["ReadWritePaths"]
    assert service.get("User") or service.get("DynamicUser") == "yes"
    assert service["CapabilityBoundingSet"] == ""
    program = Path(service["ExecStart"].split()[0])
    assert program.parent == Path("/opt/zoo-gym/bin") and program.name in scripts


def test_the_serving_unit_sees_nothing_secret_of_the_coordinator() -> None:
    """gym-serve faces the internet: of the coordinator's state it sees the models and the
    served certificate, read only; not the signing key, the CA's key or the ledger."""
    service = _unit(DEPLOY / "systemd" / "gym-serve.service")["Service"]
    home = "/var/lib/zoo-gym/coordinator"

    assert service["TemporaryFileSystem"] == "/var/lib/zoo-gym:ro"  # hides all of it
    assert service["BindReadOnlyPaths"].split() == [
        f"{home}/models",
        f"{home}/tls/server.pem",
        f"{home}/tls/server.key",
    ]
    assert service["ReadWritePaths"] == "/var/lib/zoo-gym-serve"
    assert "ReadOnlyPaths" not in service and "BindPaths" not in service
    assert f"--models {home}/models" in service["ExecStart"]


@pytest.mark.skipif(
    shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed"
)
def test_systemd_analyze_verify(tmp_path: Path) -> None:
    # the units name /opt/zoo-gym/bin/...; verify them against this tree's installed scripts
    bin_dir = Path(sys.executable).parent
    for name in ("gym-coordinator", "gym-client", "gym-serve"):
        assert (bin_dir / name).exists(), f"{name} is not installed in {bin_dir}"
    for unit in UNITS:
        (tmp_path / unit.name).write_text(
            unit.read_text().replace("/opt/zoo-gym/bin/", f"{bin_dir}/")
        )

    result = subprocess.run(
        ["systemd-analyze", "verify", *(str(tmp_path / u.name) for u in UNITS)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0 and not result.stderr.strip() and not result.stdout.strip(), (
        result.stderr
    )


# --- stopping ---------------------------------------------------------------------------------------


def test_every_deployment_waits_longer_than_serve_takes_to_stop() -> None:
    """systemd, compose and Kubernetes give serve the same grace after SIGTERM, with a margin
    over the bound serve keeps (`STOP_WITHIN_S`) before they kill it."""
    from zoo_gym.coordinator.serve import STOP_WITHIN_S

    unit = _unit(DEPLOY / "systemd" / "gym-coordinator.service")["Service"]
    compose = _compose()["services"]["coordinator"]
    deployment = (CHART / "templates" / "deployment.yaml").read_text()
    [helm] = re.findall(r"^\s+terminationGracePeriodSeconds: (\d+)$", deployment, re.MULTILINE)

    graces = {
        "systemd": int(unit["TimeoutStopSec"]),
        "compose": int(compose["stop_grace_period"].removesuffix("s")),
        "helm": int(helm),
    }
    assert unit.get("KillSignal", "SIGTERM") == "SIGTERM"
    assert len(set(graces.values())) == 1, graces
    assert min(graces.values()) >= STOP_WITHIN_S + 10, graces
    # the pod spec, not a container's, carries the grace period
    assert deployment.index("terminationGracePeriodSeconds") < deployment.index("containers:")


# --- Prometheus and Grafana ----------------------------------------------------------------------


def exported_samples(workdir: Path) -> set[str]:
    """Every sample name the coordinator's /metrics can carry, read from its real registry."""
    from zoo_gym import ledger
    from zoo_gym.coordinator.control import RoundControl
    from zoo_gym.coordinator.liveness import LoopHealth
    from zoo_gym.coordinator.metrics import CoordinatorMetrics

    metrics = CoordinatorMetrics()
    metrics.watch_ledger(ledger.open_database(f"sqlite:///{workdir / 'ledger.db'}"))
    metrics.watch_control(RoundControl())
    metrics.watch_loop(LoopHealth())
    suffixes = {
        "counter": ("_total", "_created"),
        "histogram": ("_bucket", "_count", "_sum", "_created"),
        "gauge": ("",),
    }
    return {family.name + s for family in metrics.registry.collect() for s in suffixes[family.type]}


def _dashboard_exprs() -> list[str]:
    exprs = []
    for path in sorted((DEPLOY / "grafana" / "dashboards").glob("*.json")):
        for panel in json.loads(path.read_text())["panels"]:
            exprs += [t["expr"] for t in panel["targets"]]
    return exprs


def test_dashboard_queries_exported_metrics(tmp_path: Path) -> None:
    exported = exported_samples(tmp_path)
    exprs = _dashboard_exprs()

    assert "zoo_gym_submissions_rejected_total" in exported and "zoo_gym_contributors" in exported
    assert len(exprs) >= 10
    used = {name for e in exprs for name in re.findall(r"\bzoo_gym_[a-z_]+", e)}
    assert used <= exported, f"not exported by the coordinator: {sorted(used - exported)}"
    # these families the coordinator exports are all on the dashboard
    assert {n.removesuffix("_total").removesuffix("_bucket") for n in used} >= {
        "zoo_gym_round",
        "zoo_gym_rounds",
        "zoo_gym_submissions_rejected",
        "zoo_gym_round_seconds",
        "zoo_gym_aggregation_seconds",
        "zoo_gym_ledger_entries",
        "zoo_gym_contributors",
        "zoo_gym_rounds_paused",
        "zoo_gym_round_loop_up",
        "zoo_gym_tls_certificate_expiry_timestamp_seconds",
    }


def test_grafana_provisioning() -> None:
    base = DEPLOY / "grafana" / "provisioning"
    [source] = yaml.safe_load((base / "datasources" / "prometheus.yaml").read_text())["datasources"]
    [provider] = yaml.safe_load((base / "dashboards" / "zoo-gym.yaml").read_text())["providers"]
    compose = _compose()["services"]["grafana"]

    assert source["url"] == "http://prometheus:9090"
    uids = {
        t["datasource"]["uid"]
        for p in json.loads((DEPLOY / "grafana/dashboards/zoo-gym-coordinator.json").read_text())[
            "panels"
        ]
        for t in p["targets"]
    }
    assert uids == {source["uid"]}
    assert f"./grafana/dashboards:{provider['options']['path']}:ro" in compose["volumes"]


def test_prometheus_scrapes_metrics_with_a_token() -> None:
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    [job] = config["scrape_configs"]
    compose = _compose()

    assert job["metrics_path"] == "/metrics" and job["scheme"] == "https"
    assert job["authorization"]["type"] == "Bearer"
    assert job["static_configs"][0]["targets"] == ["coordinator:8080"]
    secrets = {f"/run/secrets/{name}" for name in compose["services"]["prometheus"]["secrets"]}
    assert {job["authorization"]["credentials_file"], job["tls_config"]["ca_file"]} <= secrets
    assert config["rule_files"] == ["alerts.yml"]
    mounts = compose["services"]["prometheus"]["volumes"]
    assert "./prometheus/alerts.yml:/etc/prometheus/alerts.yml:ro" in mounts


def _alert_rules() -> list[dict[str, Any]]:
    config = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    return [rule for group in config["groups"] for rule in group["rules"]]


def test_alerts_use_exported_metrics(tmp_path: Path) -> None:
    rules = _alert_rules()
    exported = exported_samples(tmp_path) | {"up"}
    used = {name for r in rules for name in re.findall(r"\b(?:zoo_gym_[a-z_]+|up)\b", r["expr"])}

    assert {r["alert"] for r in rules} >= {
        "ZooGymCoordinatorDown",
        "ZooGymRoundLoopStopped",
        "ZooGymTlsCertificateExpiresSoon",
    }
    assert "zoo_gym_tls_certificate_expiry_timestamp_seconds" in used
    assert "zoo_gym_round_loop_up" in used
    assert used <= exported, f"not exported by the coordinator: {sorted(used - exported)}"
    for rule in rules:
        assert rule["labels"]["severity"] in ("warning", "critical")
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]


PROMTOOL = shutil.which("promtool")


@pytest.mark.skipif(
    PROMTOOL is None, reason="promtool is not installed (Debian package prometheus)"
)
def test_promtool_check_config(tmp_path: Path) -> None:
    assert PROMTOOL is not None
    source = DEPLOY / "prometheus" / "prometheus.yml"
    syntax = subprocess.run(
        [PROMTOOL, "check", "config", "--syntax-only", str(source)], capture_output=True, text=True
    )
    assert syntax.returncode == 0, syntax.stdout + syntax.stderr

    # the full check opens the files it names: give it stand-ins for the secrets
    (tmp_path / "token").write_text("zg_example\n")
    from zoo_gym.coordinator.tls import write_tls_material

    ca = write_tls_material(tmp_path / "tls", ["coordinator"]).ca_cert
    text = source.read_text().replace("/run/secrets/prometheus_token", str(tmp_path / "token"))
    (tmp_path / "prometheus.yml").write_text(text.replace("/run/secrets/coordinator_ca", str(ca)))
    shutil.copy(DEPLOY / "prometheus" / "alerts.yml", tmp_path / "alerts.yml")
    full = subprocess.run(
        [PROMTOOL, "check", "config", str(tmp_path / "prometheus.yml")],
        capture_output=True,
        text=True,
    )
    assert full.returncode == 0, full.stdout + full.stderr


@pytest.mark.skipif(
    PROMTOOL is None, reason="promtool is not installed (Debian package prometheus)"
)
def test_dashboard_promql_parses(tmp_path: Path) -> None:
    assert PROMTOOL is not None
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"zoo_gym:panel_{i}", "expr": e}
                    for i, e in enumerate(_dashboard_exprs())
                ],
            }
        ]
    }
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(rules))

    result = subprocess.run(
        [PROMTOOL, "check", "rules", str(tmp_path / "rules.yml")], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.skipif(
    PROMTOOL is None, reason="promtool is not installed (Debian package prometheus)"
)
def test_promtool_check_alert_rules() -> None:
    assert PROMTOOL is not None
    result = subprocess.run(
        [PROMTOOL, "check", "rules", str(DEPLOY / "prometheus" / "alerts.yml")],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(_alert_rules())} rules found" in result.stdout
