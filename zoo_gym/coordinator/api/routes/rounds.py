"""Rounds: history from the ledger, and the operator's controls over the round loop."""

from __future__ import annotations

from collections import Counter
from typing import Annotated

from fastapi import APIRouter, HTTPException, status
from fastapi import Path as PathParam

from zoo_gym import ledger
from zoo_gym.coordinator.api.deps import AdminDep, SessionDep, StateDep, ViewerDep
from zoo_gym.coordinator.api.schemas import (
    AbortCreate,
    ControlCreate,
    ControlPublic,
    RequestPublic,
    RoundDetail,
    RoundSummary,
)
from zoo_gym.coordinator.control import Request, RoundControl
from zoo_gym.ledger import RewardPublic, Round, RoundPublic, Session, SubmissionPublic
from zoo_gym.ledger.models import MAX_INT64

router = APIRouter(prefix="/rounds", tags=["rounds"])


def _request(request: Request | None) -> RequestPublic | None:
    if request is None:
        return None
    return RequestPublic(by=request.by, reason=request.reason, at=request.at)


def control_public(control: RoundControl) -> ControlPublic:
    state = control.state()
    return ControlPublic(
        paused=state.paused is not None,
        pause=_request(state.paused),
        start=_request(state.start),
        aborts={
            n: RequestPublic(by=r.by, reason=r.reason, at=r.at) for n, r in state.aborts.items()
        },
        current_round=state.current_round,
        policy_pending=state.policy is not None,
    )


RoundNumber = Annotated[int, PathParam(ge=0, le=MAX_INT64, description="round number")]


def _round(session: Session, number: int) -> Round:
    row = ledger.get_round(session, number=number)
    if row is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no round {number}")
    return row


@router.get("", operation_id="list_rounds", response_model=list[RoundPublic])
def list_rounds(session: SessionDep, viewer: ViewerDep) -> list[Round]:
    """Every round in the ledger, oldest first."""
    return ledger.list_rounds(session)


@router.get("/control", operation_id="get_round_control", response_model=ControlPublic)
def get_round_control(state: StateDep, viewer: ViewerDep) -> ControlPublic:
    """Pause, start and abort requests the round loop has not acted on yet."""
    return control_public(state.services.control)


@router.post("/pause", operation_id="pause_rounds", response_model=ControlPublic)
def pause_rounds(
    state: StateDep, session: SessionDep, admin: AdminDep, body: ControlCreate | None = None
) -> ControlPublic:
    """Start no new round until resumed; a round under way finishes normally."""
    reason = body.reason if body else ""
    state.services.control.pause(by=admin.actor, reason=reason)
    ledger.record_audit(
        session,
        actor=admin.actor,
        action="rounds.pause",
        target="rounds",
        detail={"reason": reason},
    )
    return control_public(state.services.control)


@router.post("/resume", operation_id="resume_rounds", response_model=ControlPublic)
def resume_rounds(
    state: StateDep, session: SessionDep, admin: AdminDep, body: ControlCreate | None = None
) -> ControlPublic:
    """Lift a pause: the loop starts the next round when it is ready."""
    if not state.services.control.resume(by=admin.actor):
        raise HTTPException(status.HTTP_409_CONFLICT, "rounds are not paused")
    ledger.record_audit(
        session,
        actor=admin.actor,
        action="rounds.resume",
        target="rounds",
        detail={"reason": body.reason if body else ""},
    )
    return control_public(state.services.control)


@router.post(
    "/start",
    operation_id="start_round",
    response_model=ControlPublic,
    status_code=status.HTTP_202_ACCEPTED,
)
def start_round(
    state: StateDep, session: SessionDep, admin: AdminDep, body: ControlCreate | None = None
) -> ControlPublic:
    """Run the next round now, even while paused (one round; the pause then holds again)."""
    reason = body.reason if body else ""
    state.services.control.request_start(by=admin.actor, reason=reason)
    ledger.record_audit(
        session,
        actor=admin.actor,
        action="rounds.start",
        target="rounds",
        detail={"reason": reason},
    )
    return control_public(state.services.control)


@router.get("/{number}", operation_id="get_round", response_model=RoundDetail)
def get_round(session: SessionDep, viewer: ViewerDep, number: RoundNumber) -> RoundDetail:
    """A round with its submissions (intake's and the aggregator's decisions) and rewards."""
    row = _round(session, number)
    return RoundDetail(
        **RoundPublic.model_validate(row).model_dump(),
        submissions=[
            SubmissionPublic.model_validate(s)
            for s in ledger.list_submissions(session, round_number=number)
        ],
        rewards=[
            RewardPublic.model_validate(r)
            for r in ledger.list_rewards(session, round_number=number)
        ],
    )


@router.get("/{number}/summary", operation_id="get_round_summary", response_model=RoundSummary)
def get_round_summary(session: SessionDep, viewer: ViewerDep, number: RoundNumber) -> RoundSummary:
    """Counts of a round: received, accepted, rejected by reason, aggregated, rewarded."""
    row = _round(session, number)
    subs = ledger.list_submissions(session, round_number=number)
    rewards = ledger.list_rewards(session, round_number=number)
    rejected = Counter(s.reason for s in subs if s.decision == "rejected")
    return RoundSummary(
        number=row.number,
        status=row.status,
        base_version=row.base_version,
        new_version=row.new_version,
        aggregator=row.aggregator,
        codec=row.codec,
        opened_at=row.opened_at,
        closed_at=row.closed_at,
        received=len(subs),
        accepted=sum(s.decision == "accepted" for s in subs),
        rejected=sum(rejected.values()),
        rejected_by_reason=dict(rejected),
        selected=sum(bool(s.selected) for s in subs),
        rewarded=len(rewards),
        rewards_total=float(sum(r.amount for r in rewards)),
        metrics=row.metrics,
    )


@router.post(
    "/{number}/abort",
    operation_id="abort_round",
    response_model=ControlPublic,
    status_code=status.HTTP_202_ACCEPTED,
)
def abort_round(
    state: StateDep, session: SessionDep, admin: AdminDep, number: RoundNumber, body: AbortCreate
) -> ControlPublic:
    """Ask the round loop to abort round `number`: nothing is aggregated or published."""
    row = _round(session, number)
    if row.status not in ("open", "aggregating"):
        raise HTTPException(status.HTTP_409_CONFLICT, f"round {number} is already {row.status}")
    state.services.control.request_abort(number, by=admin.actor, reason=body.reason)
    ledger.record_audit(
        session,
        actor=admin.actor,
        action="round.abort",
        target=f"round:{number}",
        detail={"reason": body.reason},
    )
    return control_public(state.services.control)
