"""Run a test in a network namespace whose only interface is the loopback.

Ray 2.55 (the version Flower's simulation engine pins) binds its GCS, raylet and worker
servers to every interface whatever node address it is given. A test that starts Ray runs
itself again under ``unshare --user --net`` (no privileges needed where user namespaces are
enabled) with the loopback brought up, so nothing it starts can be reached from another
machine: in that namespace "every interface" is 127.0.0.1 alone.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

_INSIDE = "ZOO_GYM_LOOPBACK_NAMESPACE"


def inside() -> bool:
    """Whether this process runs in the loopback-only namespace made by `rerun_isolated`."""
    return os.environ.get(_INSIDE) == "1"


def interfaces() -> set[str]:
    """The network interfaces of this process's namespace (/proc/net/dev: /sys/class/net
    shows those of the namespace sysfs was mounted in)."""
    lines = Path("/proc/net/dev").read_text().splitlines()[2:]  # two header lines
    return {line.split(":", 1)[0].strip() for line in lines}


def isolated(request: pytest.FixtureRequest, timeout: float) -> bool:
    """True in the loopback-only namespace: the calling test goes on with its body. Outside
    it, runs the calling test again in a new user and network namespace with only the
    loopback up, fails with its output if it fails there, and returns False (the test is
    done). Skips where this machine does not allow unprivileged user namespaces."""
    if inside():
        assert interfaces() == {"lo"}
        return True
    _rerun(request.node.nodeid, request.config.rootpath, timeout)
    return False


def _rerun(node_id: str, root: Path, timeout: float) -> None:
    unshare = shutil.which("unshare")
    probe = [unshare, "--user", "--map-root-user", "--net", "true"] if unshare else None
    if probe is None or subprocess.run(probe, capture_output=True).returncode != 0:
        pytest.skip(
            "needs unprivileged user and network namespaces (unshare) to keep Ray on 127.0.0.1"
        )
    up = "ip link set lo up" if shutil.which("ip") else "true"
    command = [
        unshare, "--user", "--map-root-user", "--net", "sh", "-c", f'{up} && exec "$@"', "sh",
        sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "", node_id,
    ]  # fmt: skip
    env = {**os.environ, _INSIDE: "1"}
    done = subprocess.run(
        command, cwd=root, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, f"{node_id} failed in its namespace:\n{done.stdout[-6000:]}"
