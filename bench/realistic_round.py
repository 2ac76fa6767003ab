"""Benchmark: one round on a model of real size, every process measured per phase.

A randomly initialised model with Qwen2.5-0.5B's configuration (24 layers, hidden 896,
intermediate 4864, 14 heads / 2 KV heads, vocabulary 151,936, tied embeddings; 494 M
parameters, 1.98 GB as float32) is saved as float32 shards, imported with
`gym-coordinator init --base-model`, served by `gym-coordinator serve` and joined by two
`gym-client join` processes on 127.0.0.1: one round of `--steps` FFA-LoRA SFT steps with
BitDelta, the coordinator's defaults otherwise (median, individual scoring), published in
shards of `--shard-size`.

Each process logs its phases (`zoo_gym.core.phases`: wall time and the phase's own peak RSS);
this script samples every process's RSS besides (every 50 ms) for its peak outside phases, and
prints one table: process, phase, seconds, peak RSS and peak RSS / the model's float32 bytes.
Goals: contributor peak RSS <= 2.5x, coordinator <= 3x, upload >= 14x smaller than the bf16
update; the last line says whether each holds. `--json PATH` writes the same as JSON.

    python bench/realistic_round.py                 # ~10 minutes on 2 cores
    python bench/realistic_round.py --steps 2 --workdir /tmp/round --keep
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from zoo_gym.core.synthetic import make_examples, shard, write_jsonl
from zoo_gym.core.tiny import task_tokenizer

MIB = 2**20
PHASE = re.compile(r"phase (\S+): ([\d.]+) s, (?:process )?peak RSS (\d+) MiB")
UPLOAD = re.compile(r"uploaded (\d+) bytes \(bf16 would be (\d+)\)")
CONTRIBUTOR_GOAL, COORDINATOR_GOAL, UPLOAD_GOAL = 2.5, 3.0, 14.0


def qwen25_05b_config() -> Qwen2Config:
    """Qwen2.5-0.5B's published configuration (config.json of Qwen/Qwen2.5-0.5B)."""
    return Qwen2Config(
        vocab_size=151_936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=32_768,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        tie_word_embeddings=True,
        use_sliding_window=False,
        sliding_window=32_768,
        max_window_layers=24,
        bos_token_id=151_643,
        eos_token_id=151_643,
    )


def build_base(directory: Path, shard_size: str) -> int:
    """Save a random model of Qwen2.5-0.5B's configuration in float32 shards, with the local
    tokenizer; returns the model's float32 bytes."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(qwen25_05b_config(), dtype=torch.float32)
    model.save_pretrained(directory, max_shard_size=shard_size)
    task_tokenizer().save_pretrained(directory)
    return sum(p.numel() * 4 for p in model.parameters())


@dataclass
class Process:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    sampled_peak: int = 0  # bytes: the largest RSS seen by sampling

    def rss(self) -> int:
        try:
            status = Path(f"/proc/{self.popen.pid}/status").read_text()
        except OSError:
            return 0
        found = re.search(r"VmRSS:\s+(\d+) kB", status)
        return int(found.group(1)) * 1024 if found else 0


@dataclass
class Run:
    workdir: Path
    steps: int
    shard_size: str
    rest_port: int = 0
    processes: list[Process] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def spawn(self, name: str, *argv: str) -> Process:
        log = self.workdir / f"{name}.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        with log.open("wb") as out:
            popen = subprocess.Popen(
                [sys.executable, "-m", *argv],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        process = Process(name, popen, log)
        self.processes.append(process)
        return process

    def sample(self) -> None:
        while not self.stop.wait(0.05):
            for p in self.processes:
                p.sampled_peak = max(p.sampled_peak, p.rss())

    @contextmanager
    def sampling(self) -> Iterator[None]:
        thread = threading.Thread(target=self.sample, daemon=True)
        thread.start()
        try:
            yield
        finally:
            self.stop.set()
            thread.join()
            for p in self.processes:
                if p.popen.poll() is None:
                    os.killpg(p.popen.pid, signal.SIGTERM)
                    p.popen.wait(timeout=30)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def prepare(run: Run) -> tuple[Path, int, int]:
    """Base model, coordinator home and two contributor homes; returns (config, port, fp32 bytes)."""
    work, home = run.workdir, run.workdir / "coordinator"
    fp32 = build_base(work / "base", run.shard_size)
    write_jsonl(make_examples(16, seed=99), work / "validation.jsonl")
    port, run.rest_port = free_port(), free_port()
    subprocess.run(
        [
            *(sys.executable, "-m", "zoo_gym.cli.coordinator", "init", "--home", str(home)),
            *("--base-model", str(work / "base"), "--validation", str(work / "validation.jsonl")),
            *("--listen", f"127.0.0.1:{port}", "--rest-listen", f"127.0.0.1:{run.rest_port}"),
        ],
        check=True,
        capture_output=True,
    )
    config = home / "coordinator.toml"
    text = config.read_text()
    text = re.sub(r"(?m)^rounds = .*$", "rounds = 1", text)
    text = re.sub(r"(?m)^steps = .*$", f"steps = {run.steps}\nbatch_size = 4", text)
    config.write_text(text.replace("[training]", f'shard_size = "{run.shard_size}"\n\n[training]'))
    for i, part in enumerate(shard(make_examples(64, seed=1), 2)):
        client = work / f"client-{i}"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "zoo_gym.cli.client",
                "init",
                "--home",
                str(client),
                "--name",
                f"client-{i}",
            ],
            check=True,
            capture_output=True,
        )
        write_jsonl(part, client / "data.jsonl")
    return config, port, fp32


def wait_until_serving(coordinator: Process, rest_port: int, timeout_s: float) -> None:
    """Wait until the coordinator's REST API answers (it starts after the gRPC service)."""
    deadline = time.monotonic() + timeout_s
    while coordinator.popen.poll() is None and time.monotonic() < deadline:
        with suppress(httpx.HTTPError):
            if httpx.get(f"http://127.0.0.1:{rest_port}/health", timeout=5).status_code == 200:
                return
        time.sleep(0.5)
    raise RuntimeError(f"the coordinator did not come up; see {coordinator.log}")


def execute(run: Run, config: Path, port: int, timeout_s: float) -> float:
    """Serve the round and join it twice; the round's wall time."""
    started = time.perf_counter()
    with run.sampling():
        coordinator = run.spawn(
            "coordinator", "zoo_gym.cli.coordinator", "serve", "-c", str(config)
        )
        wait_until_serving(
            coordinator, run.rest_port, timeout_s
        )  # join does not retry its first call
        for i in range(2):
            client = run.workdir / f"client-{i}"
            run.spawn(
                f"client-{i}",
                *("zoo_gym.cli.client", "join", f"127.0.0.1:{port}", "--home", str(client)),
                *("--data", str(client / "data.jsonl"), "--max-rounds", "1", "-v"),
            )
        deadline = time.monotonic() + timeout_s
        while any(p.popen.poll() is None for p in run.processes):
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the round did not finish in {timeout_s:.0f} s; see {run.workdir}"
                )
            time.sleep(0.5)
    seconds = time.perf_counter() - started
    failed = [p.name for p in run.processes if p.popen.returncode != 0]
    if failed or coordinator.popen.returncode != 0:
        raise RuntimeError(f"{', '.join(failed)} failed; see the logs in {run.workdir}")
    return seconds


def report(run: Run, fp32: int, seconds: float) -> dict[str, object]:
    """Per process and phase: seconds, peak RSS, ratio to the model's float32 bytes."""
    rows, peaks, upload = [], {}, (0, 0)
    for p in run.processes:
        text = p.log.read_text(errors="replace")
        phase_peak = 0
        for name, secs, mib in PHASE.findall(text):
            rows.append(
                {"process": p.name, "phase": name, "seconds": float(secs), "peak_mib": int(mib)}
            )
            phase_peak = max(phase_peak, int(mib) * MIB)
        peaks[p.name] = max(phase_peak, p.sampled_peak)
        found = UPLOAD.search(text)
        if found:
            upload = (int(found.group(1)), int(found.group(2)))
    contributor = max(v for k, v in peaks.items() if k.startswith("client")) / fp32
    coordinator = peaks["coordinator"] / fp32
    smaller = upload[1] / upload[0] if upload[0] else 0.0
    return {
        "model_fp32_bytes": fp32,
        "round_seconds": seconds,
        "phases": rows,
        "process_peak_mib": {k: round(v / MIB) for k, v in peaks.items()},
        "contributor_peak_vs_fp32": contributor,
        "coordinator_peak_vs_fp32": coordinator,
        "upload_bytes": upload[0],
        "bf16_update_bytes": upload[1],
        "upload_smaller": smaller,
        "goals_met": contributor <= CONTRIBUTOR_GOAL
        and coordinator <= COORDINATOR_GOAL
        and smaller >= UPLOAD_GOAL,
    }


def print_report(result: dict[str, object]) -> None:
    fp32 = int(result["model_fp32_bytes"])  # type: ignore[call-overload]
    print(
        f"model float32 bytes: {fp32 / MIB:.0f} MiB; round wall time {result['round_seconds']:.1f} s"
    )
    print("| process | phase | s | peak RSS MiB | x fp32 |")
    print("|---|---|---|---|---|")
    for row in result["phases"]:  # type: ignore[attr-defined]
        print(
            f"| {row['process']} | {row['phase']} | {row['seconds']:.2f} | {row['peak_mib']} | "
            f"{row['peak_mib'] * MIB / fp32:.2f} |"
        )
    for name, mib in result["process_peak_mib"].items():  # type: ignore[attr-defined]
        print(f"| {name} | whole process | - | {mib} | {mib * MIB / fp32:.2f} |")
    print(
        f"upload {result['upload_bytes']} bytes, bf16 update {result['bf16_update_bytes']} bytes "
        f"({result['upload_smaller']:.1f}x smaller; goal >= {UPLOAD_GOAL:g}x)"
    )
    print(
        f"contributor peak {result['contributor_peak_vs_fp32']:.2f}x fp32 (goal <= {CONTRIBUTOR_GOAL:g}), "
        f"coordinator peak {result['coordinator_peak_vs_fp32']:.2f}x (goal <= {COORDINATOR_GOAL:g}): "
        f"{'goals met' if result['goals_met'] else 'GOALS NOT MET'}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--shard-size", default="400MB")
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--keep", action="store_true", help="keep the working directory")
    parser.add_argument("--json", type=Path, help="also write the result as JSON here")
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="zoo-gym-realistic-"))
    workdir.mkdir(parents=True, exist_ok=True)
    run = Run(workdir, args.steps, args.shard_size)
    try:
        config, port, fp32 = prepare(run)
        result = report(run, fp32, execute(run, config, port, args.timeout))
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    print_report(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
