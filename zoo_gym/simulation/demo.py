"""A whole federation on one machine: coordinator and contributors as real processes.

Everything runs on 127.0.0.1 with free ports, a tiny model and per-client
shards of the synthetic task. Every process started here is stopped here, by
PID, whatever happens.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx

from zoo_gym.core.protocol import POLICY_OBJECTIVES
from zoo_gym.core.synthetic import make_examples, shard, write_jsonl

# GRPO / GSPO on the synthetic task: closeness (partial credit, exp(-|error| / 10)) + exact_answer.
# Exact match alone is a sparse signal for a tiny model: when every completion of a group scores
# the same, every advantage is zero. Closeness ranks near misses above far ones, so the groups
# carry a signal from the first round. `Federation.warmup_rounds` SFT rounds first give GRPO a base
# that already answers with numbers. (format rewarded printing any bare number, which the
# federation learned instead of sums; length drove it to the empty-ish reply ".")
GRPO_REWARDS = ("closeness", "exact_answer")
GRPO_TRAINING = (
    f"reward_functions = {list(GRPO_REWARDS)}".replace("'", '"'),
    "batch_size = 8",
    "num_generations = 8",
    "max_new_tokens = 8",
    "temperature = 1.0",
    "kl_beta = 0.04",
)

GRPO_SWITCH = {"training.learning_rate": 0.002}
"""What the operator changes besides the method after an SFT warm-up: a smaller step. At SFT's
0.005 (with 4 generations per prompt) the quality gate rolled back most GRPO rounds after the
warm-up; at 0.002 with 8 generations it published every one."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _python(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


@dataclass
class Federation:
    """A coordinator and its clients as child processes."""

    workdir: Path
    clients: int = 3
    rounds: int = 3
    aggregator: str = "fedavg"
    steps: int = 30
    examples_per_client: int = 120
    codec: str = "bitdelta"
    seed: int = 0
    byzantine: str = ""  # attack run by the extra `byzantine_clients` contributors; empty = none
    byzantine_clients: int = 0
    method: str = "sft"  # sft, grpo or gspo (the GRPO settings are GRPO_TRAINING)
    warmup_rounds: int = 0  # grpo / gspo: SFT rounds, then an operator switches to `method`
    stay: bool = False  # the coordinator keeps serving (REST, outcomes) after its last round
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    logs: list[IO[bytes]] = field(default_factory=list)
    port: int = 0
    rest_port: int = 0
    admin_token: str = ""
    switched: bool = False  # the warm-up's policy change has been staged

    @property
    def coordinator_home(self) -> Path:
        return self.workdir / "coordinator"

    @property
    def first_method(self) -> str:
        """The objective of round 1: SFT during a warm-up, else `method`."""
        return "sft" if self.warmup_rounds and self.method != "sft" else self.method

    @property
    def total_clients(self) -> int:
        return self.clients + (self.byzantine_clients if self.byzantine else 0)

    def client_home(self, i: int) -> Path:
        return self.workdir / self.client_name(i)

    def client_name(self, i: int) -> str:
        """Honest clients are client-0 ... client-(clients - 1); attackers come after them."""
        return f"client-{i}" if i < self.clients else f"byzantine-{i - self.clients}"

    def prepare(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port, self.rest_port = free_port(), free_port()
        subprocess.run(
            _python(
                "zoo_gym.cli.coordinator",
                "init",
                "--tiny",
                "--home",
                str(self.coordinator_home),
                "--listen",
                f"127.0.0.1:{self.port}",
                "--rest-listen",
                f"127.0.0.1:{self.rest_port}",
                "--seed",
                str(self.seed),
            ),
            check=True,
            capture_output=True,
        )
        config = self.coordinator_home / "coordinator.toml"
        lines = [
            f'listen = "127.0.0.1:{self.port}"',
            f'rest_listen = "127.0.0.1:{self.rest_port}"',
            f'validation_data = "{(self.coordinator_home / "validation.jsonl").resolve()}"',
            f"seed = {self.seed}",
            f"rounds = {self.rounds}",
            f"min_clients = {self.total_clients}",
            f'aggregator = "{self.aggregator}"',
            f"byzantine_f = {self.total_clients - self.clients}",
            "round_timeout_s = 300",
            "wait_for_clients_s = 120",
            "",
            "[training]",
            f"steps = {self.steps}",
            "learning_rate = 0.005",
            f'codec = "{self.codec}"',
            *(GRPO_TRAINING if self.method in POLICY_OBJECTIVES else ()),
            f'method = "{self.first_method}"',
        ]
        config.write_text("\n".join(lines) + "\n")
        records = make_examples(self.total_clients * self.examples_per_client, seed=self.seed + 1)
        for i, part in enumerate(shard(records, self.total_clients)):
            home = self.client_home(i)
            subprocess.run(
                _python(
                    "zoo_gym.cli.client", "init", "--home", str(home), "--name", self.client_name(i)
                ),
                check=True,
                capture_output=True,
            )
            write_jsonl(part, home / "data.jsonl")

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        log = (self.workdir / f"{name}.log").open("wb")
        self.logs.append(log)
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        }
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        self.processes[name] = proc
        return proc

    def start(self) -> None:
        self._spawn(
            "coordinator",
            _python(
                "zoo_gym.cli.coordinator",
                "serve",
                "-c",
                str(self.coordinator_home / "coordinator.toml"),
                *(("--stay",) if self.stay else ()),
            ),
        )
        # contributors start once it answers: `join` does not retry its first contact
        self.wait_until_serving()
        if self.warmup_rounds:  # before any contributor joins, so that no round starts without it
            self.create_admin_key()
        for i in range(self.total_clients):
            self.start_client(i, *(("--byzantine", self.byzantine) if i >= self.clients else ()))

    def wait_until_serving(self, timeout_s: float = 120.0) -> None:
        """Wait until the coordinator's REST API answers (it starts after the gRPC service)."""
        deadline = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if (
                    httpx.get(f"http://127.0.0.1:{self.rest_port}/health", timeout=5).status_code
                    == 200
                ):
                    break
            if self.processes["coordinator"].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"the coordinator's REST API did not come up; see {self.workdir / 'coordinator.log'}"
                )
            time.sleep(0.5)

    def create_admin_key(self) -> None:
        """An admin API key for the operator's policy change (`apikey create` needs the ledger,
        which the coordinator has made once it serves)."""
        issued = subprocess.run(
            _python(
                "zoo_gym.cli.coordinator",
                "apikey",
                "create",
                "--name",
                "demo-operator",
                "--role",
                "admin",
                "-c",
                str(self.coordinator_home / "coordinator.toml"),
                "--format",
                "json",
            ),
            check=True,
            capture_output=True,
            text=True,
        )
        self.admin_token = json.loads(issued.stdout)["token"]

    def start_client(self, i: int, *extra: str) -> subprocess.Popen[bytes]:
        return self._spawn(
            self.client_name(i),
            _python(
                "zoo_gym.cli.client",
                "join",
                f"127.0.0.1:{self.port}",
                "--home",
                str(self.client_home(i)),
                "--data",
                str(self.client_home(i) / "data.jsonl"),
                "--max-rounds",
                str(self.rounds),
                *extra,
            ),
        )

    def reward_report(
        self, i: int, *extra: str, width: int = 120
    ) -> subprocess.CompletedProcess[str]:
        """`gym-client rewards` of client i against this federation's REST API (needs `stay`)."""
        return subprocess.run(
            _python(
                "zoo_gym.cli.client",
                "rewards",
                "--home",
                str(self.client_home(i)),
                "--api",
                f"http://127.0.0.1:{self.rest_port}",
                *extra,
            ),
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "COLUMNS": str(width)},
        )

    def summaries(self) -> list[dict[str, Any]]:
        path = self.coordinator_home / "rounds.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def wait(
        self, *, timeout_s: float, on_round: Callable[[dict[str, Any]], None] | None = None
    ) -> None:
        """Until the coordinator exits (or, with `stay`, has run every round); raises if it fails
        or runs past `timeout_s`."""
        seen = 0
        deadline = time.monotonic() + timeout_s
        coordinator = self.processes["coordinator"]
        while True:
            rows = self.summaries()
            for row in rows[seen:]:
                if on_round is not None:
                    on_round(row)
            seen = len(rows)
            self.switch_after_warmup(seen)
            if self.stay and seen >= self.rounds:
                return
            code = coordinator.poll()
            if code is not None:
                if code != 0:
                    raise RuntimeError(
                        f"coordinator exited with {code}; see {self.workdir / 'coordinator.log'}"
                    )
                return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"federation did not finish in {timeout_s:.0f} s; see logs in {self.workdir}"
                )
            time.sleep(0.5)

    def api(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        """One call to the coordinator's REST API with the demo operator's admin key."""
        response = httpx.request(
            method,
            f"http://127.0.0.1:{self.rest_port}{path}",
            json=body,
            timeout=30,
            headers={"Authorization": f"Bearer {self.admin_token}"},
        )
        response.raise_for_status()
        return response.json()

    def switch_after_warmup(self, finished: int) -> None:
        """Stage `training.method = method` while round `warmup_rounds` runs, as an operator would
        (`gym-coordinator admin policy set`): the coordinator applies it from the next round on.

        Staged earlier it could catch round `warmup_rounds` itself; so it waits until that round
        is under way (or, if it was missed, over).
        """
        if self.switched or not self.warmup_rounds or self.first_method == self.method:
            return
        if finished < self.warmup_rounds - 1:
            return
        if finished < self.warmup_rounds:
            current = self.api("GET", "/rounds/control")["current_round"]
            if current != self.warmup_rounds:
                return
        self.api("PATCH", "/policy", {"training.method": self.method, **GRPO_SWITCH})
        self.switched = True

    def task_scores(self, versions: list[str]) -> dict[str, tuple[float, float]]:
        """Mean closeness and exact-answer accuracy of each model version's greedy completions on
        the coordinator's validation set (the coordinator's own scoring code)."""
        from zoo_gym.coordinator.evaluation import Evaluator
        from zoo_gym.core.weights import load_weights

        models = self.coordinator_home / "models"
        evaluator = Evaluator(models / "v0000", self.coordinator_home / "validation.jsonl")
        scores: dict[str, tuple[float, float]] = {}
        for version in dict.fromkeys(versions):
            state = load_weights(models / version)
            means = evaluator.mean_rewards(
                state, reward_functions=["closeness", "exact_answer"], max_new_tokens=8
            )
            scores[version] = (means["closeness"], means["exact_answer"])
        return scores

    def wait_clients(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        for name, proc in self.processes.items():
            if name != "coordinator":
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=max(0.1, deadline - time.monotonic()))

    def stop(self) -> None:
        """Stop every process this federation started (SIGTERM, then SIGKILL), by PID."""
        for proc in self.processes.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in self.processes.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for log in self.logs:
            log.close()

    def __enter__(self) -> Federation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
