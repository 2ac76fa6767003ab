"""Contributors: the register, operator decisions (approve, ban, unban) and reward reports."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Query, status
from sqlmodel import Session

from zoo_gym import ledger
from zoo_gym.coordinator.api.deps import AdminDep, SelfDep, SessionDep, ViewerDep
from zoo_gym.coordinator.api.schemas import (
    BanCreate,
    ContributorReport,
    ReportRow,
    ReportTotals,
    StatusCreate,
)
from zoo_gym.ledger import (
    Contributor,
    ContributorPublic,
    Reward,
    RewardPublic,
    Submission,
    SubmissionPublic,
)

router = APIRouter(prefix="/contributors", tags=["contributors"])

RoundQuery = Annotated[int | None, Query(alias="round", description="only this round")]


def _contributor(session: Session, contributor_id: str) -> Contributor:
    row = ledger.get_contributor(session, contributor_id=contributor_id)
    if row is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no contributor {contributor_id}")
    return row


@router.get("", operation_id="list_contributors", response_model=list[ContributorPublic])
def list_contributors(
    session: SessionDep,
    viewer: ViewerDep,
    status_: Annotated[
        str | None, Query(alias="status", description="active, pending or banned")
    ] = None,
) -> list[Contributor]:
    """Every registered contributor, oldest first."""
    return ledger.list_contributors(session, status=status_)


@router.get("/{contributor_id}", operation_id="get_contributor", response_model=ContributorPublic)
def get_contributor(session: SessionDep, reader: SelfDep, contributor_id: str) -> Contributor:
    return _contributor(session, contributor_id)


@router.get(
    "/{contributor_id}/submissions",
    operation_id="list_contributor_submissions",
    response_model=list[SubmissionPublic],
)
def list_contributor_submissions(
    session: SessionDep, reader: SelfDep, contributor_id: str, round_number: RoundQuery = None
) -> list[Submission]:
    _contributor(session, contributor_id)
    return ledger.list_submissions(
        session, round_number=round_number, contributor_id=contributor_id
    )


@router.get(
    "/{contributor_id}/rewards",
    operation_id="list_contributor_rewards",
    response_model=list[RewardPublic],
)
def list_contributor_rewards(
    session: SessionDep, reader: SelfDep, contributor_id: str, round_number: RoundQuery = None
) -> list[Reward]:
    _contributor(session, contributor_id)
    return ledger.list_rewards(session, round_number=round_number, contributor_id=contributor_id)


def _deciding(subs: list[Submission]) -> Submission:
    """The submission that decided a round: the accepted one, else the last received."""
    return max(subs, key=lambda s: (s.decision == "accepted", s.id or 0))


def build_report(
    session: Session, contributor: Contributor, *, round_number: int | None = None
) -> ContributorReport:
    cid = contributor.contributor_id
    subs = ledger.list_submissions(session, round_number=round_number, contributor_id=cid)
    rewards = {
        r.round_number: r
        for r in ledger.list_rewards(session, round_number=round_number, contributor_id=cid)
    }
    statuses = {r.number: r.status for r in ledger.list_rounds(session)}
    by_round: dict[int, list[Submission]] = {}
    for sub in subs:
        by_round.setdefault(sub.round_number, []).append(sub)
    rows = []
    for number in sorted(set(by_round) | set(rewards)):
        reward = rewards.get(number)
        amount = float(reward.amount) if reward is not None else None
        if number in by_round:
            sub = _deciding(by_round[number])
            rows.append(
                ReportRow(
                    round=number,
                    round_status=statuses.get(number),
                    submission_id=sub.id,
                    decision=sub.decision,
                    reason=sub.aggregation_reason or sub.reason,
                    selected=sub.selected,
                    weight=sub.weight,
                    score=sub.score,
                    quality=reward.quality if reward is not None else sub.quality,
                    reward=amount if amount is not None else float(sub.reward or 0.0),
                    received_at=sub.received_at,
                )
            )
        elif reward is not None:
            rows.append(
                ReportRow(
                    round=number,
                    round_status=statuses.get(number),
                    submission_id=None,
                    decision="none",
                    reason="rewarded without a submission",
                    selected=None,
                    weight=None,
                    score=None,
                    quality=reward.quality,
                    reward=float(reward.amount),
                    received_at=None,
                )
            )
    totals = ReportTotals(
        rounds=len(rows),
        submissions=len(subs),
        accepted=sum(s.decision == "accepted" for s in subs),
        rejected=sum(s.decision == "rejected" for s in subs),
        selected=sum(bool(s.selected) for s in subs),
        reward=float(sum(r.reward for r in rows)),
    )
    return ContributorReport(
        contributor_id=cid,
        name=contributor.name,
        status=contributor.status,
        reputation=contributor.reputation,
        rounds=rows,
        totals=totals,
    )


@router.get(
    "/{contributor_id}/report",
    operation_id="get_contributor_report",
    response_model=ContributorReport,
)
def get_contributor_report(
    session: SessionDep, reader: SelfDep, contributor_id: str, round_number: RoundQuery = None
) -> ContributorReport:
    """Per round: the decision about the contributor's update, why, its score and reward; totals."""
    return build_report(session, _contributor(session, contributor_id), round_number=round_number)


@router.post(
    "/{contributor_id}/approve",
    operation_id="approve_contributor",
    response_model=ContributorPublic,
)
def approve_contributor(
    session: SessionDep, admin: AdminDep, contributor_id: str, body: StatusCreate | None = None
) -> Contributor:
    """Let a pending contributor take part (an active one is returned unchanged)."""
    row = _contributor(session, contributor_id)
    if row.status == "active":
        return row
    if row.status == "banned":
        raise HTTPException(
            status.HTTP_409_CONFLICT, f"contributor {contributor_id} is banned; unban it instead"
        )
    reason = body.reason if body and body.reason else "approved"
    return ledger.set_contributor_status(
        session, contributor_id=contributor_id, status="active", reason=reason, actor=admin.actor
    )


@router.post(
    "/{contributor_id}/ban", operation_id="ban_contributor", response_model=ContributorPublic
)
def ban_contributor(
    session: SessionDep, admin: AdminDep, contributor_id: str, body: BanCreate
) -> Contributor:
    """Refuse the contributor's requests and submissions from now on, with the reason given."""
    _contributor(session, contributor_id)
    return ledger.set_contributor_status(
        session,
        contributor_id=contributor_id,
        status="banned",
        reason=body.reason,
        actor=admin.actor,
    )


@router.post(
    "/{contributor_id}/unban", operation_id="unban_contributor", response_model=ContributorPublic
)
def unban_contributor(
    session: SessionDep, admin: AdminDep, contributor_id: str, body: StatusCreate | None = None
) -> Contributor:
    """Lift a ban: the contributor is active again."""
    row = _contributor(session, contributor_id)
    if row.status != "banned":
        raise HTTPException(
            status.HTTP_409_CONFLICT, f"contributor {contributor_id} is {row.status}, not banned"
        )
    reason = body.reason if body and body.reason else "unbanned"
    return ledger.set_contributor_status(
        session, contributor_id=contributor_id, status="active", reason=reason, actor=admin.actor
    )
