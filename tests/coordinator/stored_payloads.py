"""A `ZooStrategy` over payloads stored in a directory, without a coordinator around it: the
strategy reads only `payload_path` of its backend while aggregating."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from zoo_gym.coordinator.strategy import ZooStrategy


class StoredPayloads:
    """The part of the backend the strategy reads while aggregating: stored payloads."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def payload_path(self, sha256: str) -> Path:
        return self.directory / sha256


def strategy_over(directory: Path, rule: str, **settings: Any) -> ZooStrategy:
    """A strategy of `rule` (f = 1, 3 clients at least, CPU) over the payloads in `directory`;
    `settings` override those."""
    defaults: dict[str, Any] = {
        "f": 1,
        "min_clients": 3,
        "clients_per_round": 0,
        "quorum": 1,
        "wait_for_clients_s": 1.0,
        "stop": threading.Event(),
        "layout": lambda: (),
        "device": "cpu",
    }
    return ZooStrategy(
        StoredPayloads(directory),  # type: ignore[arg-type]
        rule=rule,
        **{**defaults, **settings},
    )
