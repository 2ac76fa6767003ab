"""Stopping a server a test started in its own session (process group), by PID."""

from __future__ import annotations

import os
import signal
import subprocess


def stop(proc: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
    """SIGTERM the process group, SIGKILL it after `timeout_s`."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
