"""A real `gym-coordinator serve` process on 127.0.0.1, for tests that attack or load it.

Only the settings a test names are written into its `coordinator.toml`; every limit keeps its
default. Helpers live here, not in conftest.py, so test modules import them by a unique name.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
from processes import stop

from zoo_gym.simulation.demo import free_port


@dataclass
class ServeProcess:
    """A running coordinator: its gRPC address, REST base URL, home and process."""

    address: str
    rest: str
    home: Path
    proc: subprocess.Popen[bytes]

    @property
    def log(self) -> str:
        return (self.home / "serve.log").read_text(errors="replace")

    def rss_kib(self, key: str = "VmRSS") -> int:
        """The process's resident memory (`VmRSS`, or `VmHWM` for its peak) in KiB."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
        raise KeyError(key)


def toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return str(value)


def write_settings(config: Path, settings: dict[str, object]) -> None:
    """Set top-level `settings` in `config` (replacing lines that set them already)."""
    text = config.read_text()
    for key in settings:
        text = re.sub(rf"(?m)^{key} = .*\n", "", text)
    lines = "".join(f"{key} = {toml_value(value)}\n" for key, value in settings.items())
    head, sep, tail = text.partition("\n[")
    config.write_text(f"{head}\n{lines}{sep}{tail}" if sep else f"{text}\n{lines}")


@contextmanager
def serve(
    home: Path, *, wait_s: float = 60.0, stay: bool = False, **settings: object
) -> Iterator[ServeProcess]:
    """Run `gym-coordinator serve` on `home` (a `gym-coordinator init` home) until the block ends.

    It listens on free loopback ports; `settings` go into `coordinator.toml` as they are; `stay`
    keeps it serving after its last round (`--stay`).
    Stopped with SIGTERM (SIGKILL after 30 s) by its process group.
    """
    port, rest = free_port(), free_port()
    config = home / "coordinator.toml"
    write_settings(
        config, {"listen": f"127.0.0.1:{port}", "rest_listen": f"127.0.0.1:{rest}", **settings}
    )
    log = (home / "serve.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "zoo_gym.cli.coordinator", "serve", "-c", str(config)]
        + (["--stay"] if stay else []),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    served = ServeProcess(f"127.0.0.1:{port}", f"http://127.0.0.1:{rest}", home, proc)
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                if httpx.get(f"{served.rest}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"serve did not start:\n{served.log}")
            time.sleep(0.2)
        yield served
    finally:
        stop(proc)
        log.close()
