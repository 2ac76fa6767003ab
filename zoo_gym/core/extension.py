"""An optional compiled extension and the switch between it and its Python path.

The package builds its C extensions when a compiler is there (`setup.py`); without one the
import fails and the Python path, which gives the same results, runs instead. Tests and
benchmarks turn the compiled path off to compare the two.
"""

from __future__ import annotations

import importlib
from types import ModuleType


class Extension:
    """The compiled module `name` (None where it was not built) and whether it is in use."""

    def __init__(self, name: str) -> None:
        try:
            self.module: ModuleType | None = importlib.import_module(name)
        except ImportError:
            self.module = None
        self.enabled = self.module is not None

    @property
    def available(self) -> bool:
        """Whether the module was built and imports."""
        return self.module is not None

    def use(self, enabled: bool) -> bool:
        """Run through the module when `enabled` (and it was built), through the Python path
        otherwise. Returns the previous setting."""
        previous, self.enabled = self.enabled, enabled and self.module is not None
        return previous
