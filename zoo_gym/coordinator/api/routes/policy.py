"""Policy: the settings rounds run with, changed for the next round by a merge patch."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body

from zoo_gym import ledger
from zoo_gym.coordinator.api.deps import AdminDep, ApiState, SessionDep, StateDep, ViewerDep
from zoo_gym.coordinator.api.schemas import ChangePublic, PolicyPublic
from zoo_gym.coordinator.control import (
    PolicyChange,
    diff_policy,
    flatten_settings,
    merge_policy,
    policy_settings,
)
from zoo_gym.ledger import Session

router = APIRouter(prefix="/policy", tags=["policy"])

PATCH_EXAMPLES: dict[str, Any] = {
    "robust": {
        "summary": "Krum tolerating one Byzantine update",
        "value": {"aggregator": "krum", "byzantine_f": 1, "min_clients": 5},
    },
    "privacy": {"summary": "clip updates to norm 1", "value": {"training": {"clip_norm": 1.0}}},
    "codec": {"summary": "dotted keys work too", "value": {"training.codec": "int8"}},
}


def _next_round(session: Session) -> int:
    latest = ledger.latest_round(session)
    return 1 if latest is None else latest.number + 1


def policy_public(state: ApiState, session: Session) -> PolicyPublic:
    current = policy_settings(state.services.settings())
    pending = state.services.control.pending_policy()
    return PolicyPublic(
        current=current,
        pending=policy_settings(pending.config) if pending else None,
        pending_changes={
            k: ChangePublic(old=old, new=new)
            for k, (old, new) in (pending.changes if pending else {}).items()
        },
        pending_by=pending.by if pending else None,
        next_round=_next_round(session),
        settable=sorted(flatten_settings(current)),
    )


@router.get("", operation_id="get_policy", response_model=PolicyPublic)
def get_policy(state: StateDep, session: SessionDep, viewer: ViewerDep) -> PolicyPublic:
    """The policy rounds run with now, and a change staged for the next round."""
    return policy_public(state, session)


@router.patch("", operation_id="update_policy", response_model=PolicyPublic)
def update_policy(
    state: StateDep,
    session: SessionDep,
    admin: AdminDep,
    patch: Annotated[dict[str, Any], Body(openapi_examples=PATCH_EXAMPLES)],
) -> PolicyPublic:
    """Change policy settings from the next round on (a JSON merge patch of coordinator.toml's
    policy settings: aggregator, byzantine_f, quality_gate_tolerance, training.clip_norm,
    training.codec, ...). It is validated like coordinator.toml and recorded as an audit event.
    """
    current = state.services.settings()
    pending = state.services.control.pending_policy()
    base = pending.config if pending is not None else current
    updated, changes = merge_policy(base, patch)
    if changes:
        total = diff_policy(current, updated)
        state.services.control.stage_policy(
            PolicyChange(updated, total, admin.actor) if total else None
        )
        ledger.record_audit(
            session,
            actor=admin.actor,
            action="policy.update",
            target="policy",
            detail={
                "changes": {k: {"old": old, "new": new} for k, (old, new) in changes.items()},
                "from_round": _next_round(session),
            },
        )
    return policy_public(state, session)
