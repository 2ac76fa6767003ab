"""Counts a monitoring scrape reads from the ledger in a few cheap aggregate queries."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import func
from sqlmodel import Session, select

from zoo_gym.ledger.log import latest_checkpoint, log_size
from zoo_gym.ledger.models import Contributor, Round


@dataclass(frozen=True)
class LedgerStats:
    entries: int
    checkpoint_size: int
    rounds: int
    contributors: dict[str, int]


def ledger_stats(session: Session) -> LedgerStats:
    """Log size, size of the latest checkpoint, number of rounds, contributors per status."""
    head = latest_checkpoint(session)
    rounds = session.exec(select(func.count()).select_from(Round)).one()
    by_status = session.exec(
        select(Contributor.status, func.count()).group_by(Contributor.status)
    ).all()
    return LedgerStats(
        entries=log_size(session),
        checkpoint_size=head.size if head is not None else 0,
        rounds=int(rounds),
        contributors={str(status): int(n) for status, n in by_status},
    )
