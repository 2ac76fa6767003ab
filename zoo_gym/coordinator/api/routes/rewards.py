"""Rewards paid into the ledger, per round and per contributor."""

from __future__ import annotations

from fastapi import APIRouter

from zoo_gym import ledger
from zoo_gym.coordinator.api.deps import RoundQuery, SessionDep, ViewerDep
from zoo_gym.ledger import Reward, RewardPublic

router = APIRouter(prefix="/rewards", tags=["rewards"])


@router.get("", operation_id="list_rewards", response_model=list[RewardPublic])
def list_rewards(
    session: SessionDep,
    viewer: ViewerDep,
    round_number: RoundQuery = None,
    contributor_id: str | None = None,
) -> list[Reward]:
    """Rewards, oldest first, optionally of one round and/or one contributor."""
    return ledger.list_rewards(session, round_number=round_number, contributor_id=contributor_id)
