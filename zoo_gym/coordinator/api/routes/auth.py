"""Contributor sign-in: a nonce challenge signed with the contributor's Ed25519 key."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, Request, status

from zoo_gym import ledger
from zoo_gym.coordinator.api.auth import TooManyChallenges
from zoo_gym.coordinator.api.deps import SessionDep, StateDep, unauthorized
from zoo_gym.coordinator.api.limits import client_address, refuse_credential, take_sign_in
from zoo_gym.coordinator.api.schemas import (
    ChallengeCreate,
    ChallengePublic,
    TokenCreate,
    TokenPublic,
)
from zoo_gym.core.identity import verify

router = APIRouter(prefix="/auth", tags=["auth"])


@router.post("/challenge", operation_id="auth_challenge", response_model=ChallengePublic)
def create_challenge(request: Request, state: StateDep, body: ChallengeCreate) -> ChallengePublic:
    """A single-use nonce to sign; it expires after two minutes."""
    take_sign_in(state.guard, client_address(request))
    try:
        issued = state.auth.challenge(body.contributor_id)
    except TooManyChallenges:
        raise HTTPException(
            status.HTTP_429_TOO_MANY_REQUESTS, "too many pending challenges; retry shortly"
        ) from None
    return ChallengePublic(
        contributor_id=issued.contributor_id,
        nonce=issued.nonce,
        expires_at_ms=issued.expires_at_ms,
        statement=issued.statement.decode(),
    )


@router.post("/token", operation_id="auth_token", response_model=TokenPublic)
def create_token(
    request: Request, state: StateDep, session: SessionDep, body: TokenCreate
) -> TokenPublic:
    """Exchange a signed challenge for a bearer token scoped to that contributor."""
    address = client_address(request)
    take_sign_in(state.guard, address)
    named = f"contributor:{body.contributor_id}"
    issued = state.auth.redeem(body.contributor_id, body.nonce)
    if issued is None:
        raise refuse_credential(
            state.guard,
            address,
            named,
            unauthorized("the challenge is unknown, used or expired; request a new one"),
        )
    contributor = ledger.get_contributor(session, contributor_id=body.contributor_id)
    try:
        signature = bytes.fromhex(body.signature)
    except ValueError:
        signature = b""
    if contributor is None or not verify(
        bytes(contributor.public_key), signature, issued.statement
    ):
        raise refuse_credential(
            state.guard,
            address,
            named,
            unauthorized("the signature does not match the contributor's registered key"),
        )
    token, expires = state.auth.issue_token(body.contributor_id)
    return TokenPublic(
        contributor_id=body.contributor_id, access_token=token, expires_at_ms=expires
    )
