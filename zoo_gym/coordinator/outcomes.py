"""What the coordinator decided about a contributor's submission for a round."""

from __future__ import annotations

from zoo_gym import ledger
from zoo_gym.core.protocol import Outcome
from zoo_gym.ledger import Engine, Session


def outcome(engine: Engine, contributor_id: str, round_number: int) -> Outcome:
    """The decision about `contributor_id`'s submission for a round: its accepted one when it
    has one, else its latest; "none" when it sent none."""
    with Session(engine) as session:
        rnd = ledger.get_round(session, number=round_number)
        subs = ledger.list_submissions(
            session, round_number=round_number, contributor_id=contributor_id
        )
        if rnd is None or not subs:
            return Outcome(
                "none",
                "no submission from you for this round",
                round_status=rnd.status if rnd else "",
            )
        sub = sorted(subs, key=lambda s: (s.decision == "accepted", s.id or 0))[-1]
        reason = sub.aggregation_reason or sub.reason
        return Outcome(
            sub.decision,
            reason,
            float(sub.quality or 0.0),
            float(sub.reward or 0.0),
            rnd.status,
            rnd.new_version or "",
        )
