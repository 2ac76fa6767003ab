"""What a contributor's machine remembers between runs (a JSON file).

It pins the coordinator key seen at first registration, records every
round submitted to, so a restarted client never submits twice for a round, and
keeps the newest ledger checkpoint it verified per coordinator key (the JSON
form of `zoo_gym.core.checkpoints`), so `gym-client rewards --verify` can
require that the coordinator's log only ever grew from it.
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
class RoundRecord:
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
    contributions: dict[str, RoundRecord] = field(default_factory=dict)
    privacy: PrivacyAccount = field(default_factory=PrivacyAccount)  # every DP mechanism so far
    checkpoints: dict[str, dict[str, Any]] = field(default_factory=dict)  # key hex -> checkpoint

    @classmethod
    def load(cls, path: Path) -> LocalState:
        if not path.exists():
            return cls(path)
        data: dict[str, Any] = json.loads(path.read_text())
        contributions = {k: RoundRecord(**v) for k, v in data.get("contributions", {}).items()}
        return cls(
            path,
            data.get("coordinator", ""),
            data.get("coordinator_key", ""),
            data.get("contributor_id", ""),
            contributions,
            privacy=PrivacyAccount.from_json(data.get("privacy", {})),
            checkpoints=dict(data.get("checkpoints", {})),
        )

    def save(self) -> None:
        self.checkpoints = _newest(self.checkpoints, _stored_checkpoints(self.path))
        body = {
            "format": STATE_FORMAT,
            "coordinator": self.coordinator,
            "coordinator_key": self.coordinator_key,
            "contributor_id": self.contributor_id,
            "contributions": {k: asdict(v) for k, v in self.contributions.items()},
            "privacy": self.privacy.to_json(),
            "checkpoints": self.checkpoints,
        }
        write_atomic(self.path, json.dumps(body, indent=1).encode())

    def submitted(self, round_number: int) -> bool:
        c = self.contributions.get(str(round_number))
        return c is not None and c.decision == "accepted"

    def record(self, contribution: RoundRecord) -> None:
        self.contributions[str(contribution.round)] = contribution
        self.save()


def _stored_checkpoints(path: Path) -> dict[str, dict[str, Any]]:
    """The checkpoints in the state file on disk now (another command may have added one)."""
    try:
        stored = json.loads(path.read_text()).get("checkpoints", {})
    except (OSError, ValueError, AttributeError):
        return {}
    return stored if isinstance(stored, dict) else {}


def _newest(
    ours: dict[str, dict[str, Any]], theirs: dict[str, dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """Per coordinator key the larger of two remembered checkpoints, so that `join` saving its
    state never replaces a newer checkpoint `rewards --verify` stored meanwhile."""
    merged = dict(theirs)
    for key, head in ours.items():
        if _size(head) >= _size(merged.get(key)):
            merged[key] = head
    return merged


def _size(head: Any) -> int:
    """The size of a remembered checkpoint; -1 for anything that is not one."""
    try:
        return int(head["size"])
    except (KeyError, TypeError, ValueError):
        return -1
