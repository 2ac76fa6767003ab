"""Contributors: the register, operator decisions (approve, ban, unban) and reward reports
(with the log entries that recorded each reward, for checking them against a checkpoint)."""

from __future__ import annotations

import re
from datetime import timedelta
from decimal import Decimal
from typing import Annotated

from fastapi import APIRouter, HTTPException, Query, status

from zoo_gym import ledger
from zoo_gym.coordinator.api.deps import AdminDep, RoundQuery, SelfDep, SessionDep, ViewerDep
from zoo_gym.coordinator.api.schemas import (
    BanCreate,
    ContributorReport,
    InviteCreate,
    InviteIssued,
    ReportRow,
    ReportTotals,
    StatusCreate,
)
from zoo_gym.ledger import (
    Contributor,
    ContributorPublic,
    Invite,
    InvitePublic,
    LogEntry,
    LogEntryPublic,
    Reward,
    RewardPublic,
    Session,
    Submission,
    SubmissionPublic,
)

router = APIRouter(prefix="/contributors", tags=["contributors"])

ZERO = Decimal(0)


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


@router.post(
    "/invites",
    operation_id="create_invite",
    response_model=InviteIssued,
    status_code=status.HTTP_201_CREATED,
)
def create_invite(session: SessionDep, admin: AdminDep, body: InviteCreate) -> InviteIssued:
    """Issue an invitation code for `admission = "invite"`. The code is in this answer only;
    the ledger keeps its hash, and records its issue and each use as audit events."""
    issued = ledger.create_invite(
        session,
        note=body.note,
        max_uses=body.uses,
        valid_for=timedelta(hours=body.valid_for_hours),
        actor=admin.actor,
    )
    public = InvitePublic.model_validate(issued.invite, from_attributes=True)
    return InviteIssued(**public.model_dump(), code=issued.code)


@router.get("/invites", operation_id="list_invites", response_model=list[InvitePublic])
def list_invites(
    session: SessionDep,
    admin: AdminDep,
    usable: Annotated[bool, Query(description="only codes that still admit")] = False,
) -> list[Invite]:
    """Every invitation (never its code), oldest first."""
    return ledger.list_invites(session, include_spent=not usable)


@router.post("/invites/{prefix}/revoke", operation_id="revoke_invite", response_model=InvitePublic)
def revoke_invite(session: SessionDep, admin: AdminDep, prefix: str) -> Invite:
    """Revoke an invitation by the prefix shown in the list; its unused admissions lapse."""
    if not re.fullmatch(r"[0-9a-f]{8}", prefix):
        raise HTTPException(
            status.HTTP_404_NOT_FOUND,
            "no invitation with that prefix; an invitation's prefix is 8 hex digits",
        )
    return ledger.revoke_invite(session, prefix=prefix, actor=admin.actor)


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


@router.get(
    "/{contributor_id}/rewards/entries",
    operation_id="list_contributor_reward_entries",
    response_model=list[LogEntryPublic],
)
def list_contributor_reward_entries(
    session: SessionDep, reader: SelfDep, contributor_id: str
) -> list[LogEntryPublic]:
    """The log entries that recorded the contributor's rewards (canonical JSON records), oldest
    first: with `/ledger/proofs/inclusion` and `/ledger/checkpoint` a contributor checks its
    report against the signed log without reading anyone else's records."""
    _contributor(session, contributor_id)
    entries = ledger.reward_entries(session, contributor_id=contributor_id).values()
    return [LogEntryPublic.model_validate(e) for e in sorted(entries, key=lambda e: e.index)]


def _deciding(subs: list[Submission]) -> Submission:
    """The submission that decided a round: the accepted one, else the last received."""
    return max(subs, key=lambda s: (s.decision == "accepted", s.id or 0))


def _epsilon(subs: list[Submission]) -> float | None:
    """Privacy a round's submissions spent: the sum of their epsilon (basic composition)."""
    spent = [s.epsilon for s in subs if s.epsilon is not None]
    return float(sum(spent)) if spent else None


def _total_epsilon(subs: list[Submission]) -> tuple[float | None, float | None]:
    """(epsilon, delta) of everything the contributor's submissions report.

    When every submission that reports privacy also states its DP-SGD mechanism, the mechanisms
    are composed with the RDP accountant and the epsilon is given for the smallest delta they
    name. Otherwise (submissions recorded before mechanisms were kept) it is the sum of the
    reported epsilons, basic composition, with no single delta.
    """
    from zoo_gym.privacy.accounting import epsilon_of_history

    private = [s for s in subs if s.epsilon is not None or s.dp_mechanism is not None]
    if not private:
        return None, None
    mechanisms = [m for s in private if (m := s.dp_mechanism) is not None]
    if len(mechanisms) < len(private):
        return float(sum(s.epsilon or 0.0 for s in private)), None
    delta = min(m.delta for m in mechanisms)
    history = [(m.noise_multiplier, m.sample_rate, m.steps) for m in mechanisms]
    return epsilon_of_history(history, delta, "rdp"), delta


def _row(
    number: int,
    status_: str | None,
    subs: list[Submission],
    reward: Reward | None,
    entry: LogEntry | None,
) -> ReportRow:
    sub = _deciding(subs) if subs else None
    amount = reward.amount if reward is not None else ZERO
    quality = sub.quality if sub is not None else None
    return ReportRow(
        round=number,
        round_status=status_,
        submission_id=sub.id if sub is not None else None,
        decision=sub.decision if sub is not None else "none",
        reason=(sub.aggregation_reason or sub.reason) if sub is not None else "no submission",
        selected=sub.selected if sub is not None else None,
        weight=sub.weight if sub is not None else None,
        score=sub.score if sub is not None else None,
        quality=reward.quality if reward is not None else quality,
        reward=float(amount),
        amount=amount,
        reward_reason=reward.reason if reward is not None else "",
        reputation_after=reward.reputation_after if reward is not None else None,
        epsilon=_epsilon(subs),
        reward_id=reward.id if reward is not None else None,
        log_index=entry.index if entry is not None else None,
        received_at=sub.received_at if sub is not None else None,
    )


def build_report(
    session: Session, contributor: Contributor, *, round_number: int | None = None
) -> ContributorReport:
    """Per round: the contributor's submission(s) and its reward (an intake-rejected submission
    has no reward row: it is reported as zero with intake's reason); totals."""
    cid = contributor.contributor_id
    subs = ledger.list_submissions(session, round_number=round_number, contributor_id=cid)
    rewards = {
        r.round_number: r
        for r in ledger.list_rewards(session, round_number=round_number, contributor_id=cid)
    }
    entries = ledger.reward_entries(session, contributor_id=cid) if rewards else {}
    statuses = {r.number: r.status for r in ledger.list_rounds(session)}
    by_round: dict[int, list[Submission]] = {}
    for sub in subs:
        by_round.setdefault(sub.round_number, []).append(sub)
    rows = []
    for number in sorted(set(by_round) | set(rewards)):
        reward = rewards.get(number)
        entry = entries.get(reward.id) if reward is not None and reward.id is not None else None
        rows.append(_row(number, statuses.get(number), by_round.get(number, []), reward, entry))
    amount = sum((r.amount for r in rows), ZERO)
    epsilon, delta = _total_epsilon(subs)
    totals = ReportTotals(
        rounds=len(rows),
        submissions=len(subs),
        accepted=sum(s.decision == "accepted" for s in subs),
        rejected=sum(s.decision == "rejected" for s in subs),
        selected=sum(bool(s.selected) for s in subs),
        rewarded=sum(r.amount > 0 for r in rows),
        reward=float(amount),
        amount=amount,
        epsilon=epsilon,
        epsilon_delta=delta,
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
    """A contributor's statement. Per round: the decision about its update and why, the quality
    score, the reward (exact decimal string and the reason), the reputation after the round, the
    privacy spent (epsilon) and the log entry that recorded the reward; totals."""
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
