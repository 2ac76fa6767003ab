"""Request and response bodies of the REST API, layered Base -> Create -> Public.

Ledger rows are returned as the ledger's own Public models (`RoundPublic`, `SubmissionPublic`,
...); this module adds what the API composes from them.
"""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal
from typing import Annotated, Any

from pydantic import BaseModel, Field, PlainSerializer

from zoo_gym.core.identity import CONTRIBUTOR_ID
from zoo_gym.ledger import (
    CheckpointPublic,
    InvitePublic,
    LogEntryPublic,
    RewardPublic,
    RoundPublic,
    SubmissionPublic,
)
from zoo_gym.ledger.models import AMOUNT_SCALE

# --- contributor sign-in ------------------------------------------------------------------------


class ChallengeBase(BaseModel):
    contributor_id: str = Field(pattern=CONTRIBUTOR_ID, description="32 hex digits")


class ChallengeCreate(ChallengeBase):
    pass


class ChallengePublic(ChallengeBase):
    nonce: str
    expires_at_ms: int
    statement: str = Field(
        description="what to sign, for reference: "
        "zoo-gym/rest-auth/v1|<contributor_id>|<nonce>|<expires_at_ms> (build it yourself)"
    )


class TokenCreate(ChallengeBase):
    nonce: str
    signature: str = Field(description="hex Ed25519 signature of the challenge statement")


class TokenPublic(ChallengeBase):
    access_token: str
    token_type: str = "bearer"
    expires_at_ms: int


# --- rounds -------------------------------------------------------------------------------------


class RoundDetail(RoundPublic):
    """A round with every submission (intake's decision, the aggregator's decision) and reward."""

    submissions: list[SubmissionPublic]
    rewards: list[RewardPublic]


class RoundSummary(BaseModel):
    number: int
    status: str
    base_version: str
    new_version: str | None
    aggregator: str
    codec: str
    opened_at: datetime
    closed_at: datetime | None
    received: int
    accepted: int
    rejected: int
    rejected_by_reason: dict[str, int]
    selected: int = Field(description="accepted updates the aggregator used")
    rewarded: int
    rewards_total: float
    metrics: dict[str, Any]


class ControlBase(BaseModel):
    reason: str = Field("", max_length=500)


class ControlCreate(ControlBase):
    pass


class AbortCreate(ControlBase):
    reason: str = Field(min_length=1, max_length=500)


class RequestPublic(ControlBase):
    by: str
    at: datetime


class ControlPublic(BaseModel):
    """Operator requests the round loop has not acted on yet."""

    paused: bool
    pause: RequestPublic | None
    start: RequestPublic | None
    aborts: dict[int, RequestPublic]
    current_round: int | None
    policy_pending: bool


# --- contributors -------------------------------------------------------------------------------


class StatusCreate(ControlBase):
    pass


class BanCreate(ControlBase):
    reason: str = Field(min_length=1, max_length=500)


class InviteCreate(BaseModel):
    """An invitation code to issue (for `admission = "invite"`)."""

    note: str = Field(
        "",
        max_length=128,
        pattern=r"^[^\x00-\x1f\x7f]*$",
        description="whom it is for (one line of text); shown in the list",
    )
    uses: int = Field(1, ge=1, le=1_000_000, description="new keys it may admit")
    valid_for_hours: float = Field(
        72.0, ge=1 / 60, le=366 * 24, description="hours until it expires"
    )


class InviteIssued(InvitePublic):
    """A new invitation with its code: shown once, only its hash is kept."""

    code: str


REPORT_VERSION = 2
"""Version of `ContributorReport` (2: exact amounts, reputation, epsilon and log indices)."""


def _exact(amount: Decimal) -> str:
    return f"{amount:.{AMOUNT_SCALE}f}"


Amount = Annotated[
    Decimal,
    PlainSerializer(_exact, return_type=str, when_used="json"),
    Field(description='exact decimal with 9 places, as a string (e.g. "5.000000000")'),
]


class ReportRow(BaseModel):
    """What happened to a contributor in one round: its submission(s) and its reward."""

    round: int
    round_status: str | None
    submission_id: int | None = Field(description="the submission that decided the round")
    decision: str = Field(description="accepted or rejected (at intake); none without submission")
    reason: str = Field(
        description="why: the aggregator's reason for an accepted update, intake's for a rejected one"
    )
    selected: bool | None
    weight: float | None
    score: float | None = Field(description="the aggregator's score of the update")
    quality: float | None = Field(description="quality of the contribution (None: not scored)")
    reward: float = Field(description="`amount` as a float, for display")
    amount: Amount
    reward_reason: str = Field(description="why the reward is what it is; empty when unpaid")
    reputation_after: float | None = Field(description="reputation after the round's reward")
    epsilon: float | None = Field(
        description="privacy spent in the round: the sum of its submissions' epsilon "
        "(basic composition); None when none reported one"
    )
    reward_id: int | None
    log_index: int | None = Field(
        description="index of the log entry that recorded the reward "
        "(its record: GET /contributors/{id}/rewards/entries; proof: /ledger/proofs/inclusion)"
    )
    received_at: datetime | None


class ReportTotals(BaseModel):
    rounds: int
    submissions: int
    accepted: int
    rejected: int
    selected: int
    rewarded: int = Field(description="rounds with a positive reward")
    reward: float = Field(description="`amount` as a float, for display")
    amount: Amount
    epsilon: float | None = Field(
        description="privacy spent over all rounds: the stated DP-SGD mechanisms composed with "
        "the RDP accountant, for `epsilon_delta`; the sum of the rounds' epsilon (basic "
        "composition) when some round stated no mechanism; None when no round reported one"
    )
    epsilon_delta: float | None = Field(
        default=None,
        description="the delta `epsilon` holds for (the smallest the rounds name); None for a sum",
    )


class ContributorReport(BaseModel):
    """A contributor's statement: per round, the decision, why, quality, reward, reputation after
    and privacy spent; totals. Each reward names the log entry that recorded it, so the statement
    can be checked against a signed checkpoint."""

    version: int = REPORT_VERSION
    contributor_id: str
    name: str
    status: str
    reputation: float
    rounds: list[ReportRow]
    totals: ReportTotals


# --- policy -------------------------------------------------------------------------------------


class ChangePublic(BaseModel):
    old: Any
    new: Any


class PolicyPublic(BaseModel):
    """The policy rounds run with now and a change staged for the next round."""

    current: dict[str, Any]
    pending: dict[str, Any] | None
    pending_changes: dict[str, ChangePublic]
    pending_by: str | None
    next_round: int
    settable: list[str]


# --- models -------------------------------------------------------------------------------------


class ModelSummary(BaseModel):
    version: str
    parent: str | None
    round: int
    aggregator: str
    contributors: int
    files: int
    size_bytes: int
    manifest_sha256: str
    created_at: float
    published_at: datetime | None
    metrics: dict[str, float]
    epsilon: float | None


class ManifestPublic(BaseModel):
    version: str
    manifest: dict[str, Any]
    manifest_sha256: str
    signature: str = Field(description="hex Ed25519 signature of manifest.json's bytes")


# --- ledger -------------------------------------------------------------------------------------


class LedgerPage(BaseModel):
    size: int
    start: int
    limit: int
    entries: list[LogEntryPublic]


class CheckpointSigned(CheckpointPublic):
    public_key: str = Field(description="hex Ed25519 key of the coordinator that signed it")


class InclusionProofPublic(BaseModel):
    index: int
    tree_size: int
    leaf_hash: str
    path: list[str]
    root: str


class ConsistencyProofPublic(BaseModel):
    old_size: int
    new_size: int
    old_root: str
    new_root: str
    path: list[str]
