"""Writing files that readers (or a crash) never see half-written."""

from __future__ import annotations

import os
from pathlib import Path


def write_atomic(path: Path, data: bytes, *, mode: int = 0o644) -> None:
    """Write `data` to `path`: a reader sees the old file or the new one, never part of one.

    The bytes go to a hidden staging file beside `path` (created with `mode`, so a key is never
    readable by others even for a moment), are flushed to disk, then renamed over `path`.
    """
    staging = path.with_name(f".{path.name}.tmp")
    staging.unlink(missing_ok=True)
    fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(staging, path)
