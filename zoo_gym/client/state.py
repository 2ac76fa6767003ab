"""What a contributor's machine remembers between runs (a JSON file).

It pins the coordinator key seen at first registration, and records every
round submitted to, so a restarted client never submits twice for a round.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from zoo_gym.client.privacy import PrivacyAccount
from zoo_gym.core.files import write_atomic

STATE_FORMAT = 1


@dataclass
class Contribution:
    round: int
    message_id: str
    base_version: str
    decision: str
    reason: str
    payload_bytes: int
    raw_bytes: int
    train_loss: float
    reward: float = 0.0
    quality: float = 0.0
    final: bool = False


@dataclass
class LocalState:
    path: Path
    coordinator: str = ""
    coordinator_key: str = ""
    contributor_id: str = ""
    contributions: dict[str, Contribution] = field(default_factory=dict)
    privacy: PrivacyAccount = field(default_factory=PrivacyAccount)  # every DP mechanism so far

    @classmethod
    def load(cls, path: Path) -> LocalState:
        if not path.exists():
            return cls(path)
        data: dict[str, Any] = json.loads(path.read_text())
        contributions = {k: Contribution(**v) for k, v in data.get("contributions", {}).items()}
        return cls(
            path,
            data.get("coordinator", ""),
            data.get("coordinator_key", ""),
            data.get("contributor_id", ""),
            contributions,
            privacy=PrivacyAccount.from_json(data.get("privacy", {})),
        )

    def save(self) -> None:
        body = {
            "format": STATE_FORMAT,
            "coordinator": self.coordinator,
            "coordinator_key": self.coordinator_key,
            "contributor_id": self.contributor_id,
            "contributions": {k: asdict(v) for k, v in self.contributions.items()},
            "privacy": self.privacy.to_json(),
        }
        write_atomic(self.path, json.dumps(body, indent=1).encode())

    def submitted(self, round_number: int) -> bool:
        c = self.contributions.get(str(round_number))
        return c is not None and c.decision == "accepted"

    def record(self, contribution: Contribution) -> None:
        self.contributions[str(contribution.round)] = contribution
        self.save()
