"""Wall time and peak resident memory of the named phases of a process.

``with phase("merge"):`` logs one line when the block ends, on the ``zoo_gym.core.phases``
logger at INFO::

    phase merge: 1.84 s, peak RSS 4113 MiB (round 3)

The peak is the block's own: on Linux the kernel's high-water mark (``VmHWM``) is
reset to the current RSS when a phase starts (``/proc/self/clear_refs``, value 5) and
read when it ends. A phase inside another reports its own peak and hands it on, so the
outer phase's peak still covers the inner one. Each thread keeps its own phases; the mark
is the process's, so a phase that overlaps a phase of another thread reports the peak since
the later of their starts. Where the mark cannot be reset (not
Linux, or a kernel without it) the peak is the process's since it started
(`resource.getrusage`), and the line says ``process peak RSS``.
"""

from __future__ import annotations

import logging
import re
import resource
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
_HWM = re.compile(rb"VmHWM:\s+(\d+) kB")
MIB = 2**20


@dataclass
class _Open:
    name: str
    started: float
    inner_peak: int = 0  # the largest peak of the phases that ended inside this one


class PhaseClock(threading.local):
    """The phases open in this thread, innermost last."""

    resettable: bool | None = None  # None: not tried yet

    def __init__(self) -> None:
        self.stack: list[_Open] = []

    def peak_bytes(self) -> int:
        """The resident high-water mark: since the last reset, or of the whole process."""
        if self.resettable:
            found = _HWM.search(_STATUS.read_bytes())
            if found:
                return int(found.group(1)) * 1024
        scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, else KiB
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale

    def reset(self) -> None:
        """Start a new high-water mark at the current RSS, where the kernel allows it."""
        if self.resettable is False:
            return
        try:
            _CLEAR_REFS.write_text("5")
            self.resettable = _HWM.search(_STATUS.read_bytes()) is not None
        except OSError:
            self.resettable = False

    def start(self, name: str) -> None:
        if self.stack:  # what the enclosing phase reached so far is kept before the reset
            outer = self.stack[-1]
            outer.inner_peak = max(outer.inner_peak, self.peak_bytes())
        self.reset()
        self.stack.append(_Open(name, time.perf_counter()))

    def stop(self) -> tuple[str, float, int]:
        """End the innermost phase: its name, seconds and peak bytes."""
        done = self.stack.pop()
        peak = max(self.peak_bytes(), done.inner_peak)
        if self.stack:
            self.stack[-1].inner_peak = max(self.stack[-1].inner_peak, peak)
        return done.name, time.perf_counter() - done.started, peak


CLOCK = PhaseClock()


@contextmanager
def phase(name: str, detail: str = "") -> Iterator[None]:
    """Log the wall time and peak RSS of the block as phase `name` (module docstring)."""
    CLOCK.start(name)
    try:
        yield
    finally:
        name, seconds, peak = CLOCK.stop()
        scope = "peak RSS" if CLOCK.resettable else "process peak RSS"
        log.info(
            "phase %s: %.2f s, %s %d MiB%s",
            name,
            seconds,
            scope,
            round(peak / MIB),
            f" ({detail})" if detail else "",
        )
