"""A contributor's reward statement as the coordinator reports it (`GET /contributors/{id}/report`):
per round the decision and why, the quality score, the reward (an exact decimal), the reputation
after the round, the privacy spent (epsilon) and the index of the log entry that recorded the
reward; totals.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any

AMOUNT_PLACES = 9


class RewardsError(Exception):
    """The statement cannot be fetched, read or trusted; the message says what to do."""


def parse_amount(value: Any) -> Decimal:
    amount = Decimal(str(value))
    if not amount.is_finite():
        raise ValueError(f"amount {value!r} is not a finite decimal")
    return amount


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)


@dataclass(frozen=True)
class RoundLine:
    """One round of the statement."""

    round: int
    round_status: str | None
    decision: str
    reason: str
    reward_reason: str
    selected: bool | None
    score: float | None
    quality: float | None
    amount: Decimal
    reputation_after: float | None
    epsilon: float | None
    reward_id: int | None
    log_index: int | None

    @classmethod
    def from_json(cls, row: dict[str, Any]) -> RoundLine:
        return cls(
            round=int(row["round"]),
            round_status=row.get("round_status"),
            decision=str(row["decision"]),
            reason=str(row.get("reason") or ""),
            reward_reason=str(row.get("reward_reason") or ""),
            selected=row.get("selected"),
            score=_opt_float(row.get("score")),
            quality=_opt_float(row.get("quality")),
            amount=parse_amount(row["amount"]),
            reputation_after=_opt_float(row.get("reputation_after")),
            epsilon=_opt_float(row.get("epsilon")),
            reward_id=_opt_int(row.get("reward_id")),
            log_index=_opt_int(row.get("log_index")),
        )

    @property
    def why(self) -> str:
        """The decision's reason and, when it says more, the reward's."""
        if self.reason and self.reason in self.reward_reason:  # the reward's reason repeats it
            return self.reward_reason
        if self.reward_reason and self.reward_reason != self.reason:
            return f"{self.reason}; {self.reward_reason}" if self.reason else self.reward_reason
        return self.reason


@dataclass(frozen=True)
class Totals:
    rounds: int
    submissions: int
    accepted: int
    rejected: int
    selected: int
    rewarded: int
    amount: Decimal
    epsilon: float | None
    epsilon_delta: float | None = None  # the delta a composed epsilon holds for; None for a sum


@dataclass(frozen=True)
class Statement:
    """A contributor's report as the coordinator served it (`raw`) and parsed."""

    contributor_id: str
    name: str
    status: str
    reputation: float
    rounds: tuple[RoundLine, ...]
    totals: Totals
    raw: dict[str, Any] = field(repr=False)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Statement:
        try:
            t = data["totals"]
            totals = Totals(
                rounds=int(t["rounds"]),
                submissions=int(t["submissions"]),
                accepted=int(t["accepted"]),
                rejected=int(t["rejected"]),
                selected=int(t["selected"]),
                rewarded=int(t["rewarded"]),
                amount=parse_amount(t["amount"]),
                epsilon=_opt_float(t.get("epsilon")),
                epsilon_delta=_opt_float(t.get("epsilon_delta")),
            )
            return cls(
                contributor_id=str(data["contributor_id"]),
                name=str(data["name"]),
                status=str(data["status"]),
                reputation=float(data["reputation"]),
                rounds=tuple(RoundLine.from_json(r) for r in data["rounds"]),
                totals=totals,
                raw=data,
            )
        except (KeyError, TypeError, ValueError, InvalidOperation) as exc:
            raise RewardsError(
                f"the coordinator's report (version {data.get('version', 1)}) is not in a form "
                f"this client reads ({type(exc).__name__}: {exc}); update zoo-gym"
            ) from None
