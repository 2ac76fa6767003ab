"""Ledger tables, layered Base -> Create -> table -> Public.

Times are timezone-aware UTC datetimes (microsecond precision on every backend). Rows are never
deleted; every change to a row goes through a repository function that also appends a log entry
(`zoo_gym.ledger.log`), so each column's current value is backed by the Merkle log.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any, Literal

from pydantic import field_serializer, field_validator
from sqlalchemy import JSON, BigInteger, Index, LargeBinary, Numeric, UniqueConstraint, text
from sqlmodel import Field, SQLModel

ContributorStatus = Literal["active", "pending", "banned"]
RoundStatus = Literal["open", "aggregating", "published", "rolled_back", "aborted"]
Decision = Literal["accepted", "rejected"]

CONTRIBUTOR_STATUSES: frozenset[str] = frozenset({"active", "pending", "banned"})
ROUND_STATUSES: frozenset[str] = frozenset(
    {"open", "aggregating", "published", "rolled_back", "aborted"}
)
CLOSED_ROUND_STATUSES: frozenset[str] = frozenset({"published", "rolled_back", "aborted"})
DECISIONS: frozenset[str] = frozenset({"accepted", "rejected"})


#: reward amounts are exact decimals with 9 places (the smallest unit a reward policy may pay)
AMOUNT_DIGITS, AMOUNT_SCALE = 38, 9
MAX_INT64 = 2**63 - 1  # the largest value of the ledger's integer columns


def fixed_amount(amount: Decimal) -> str:
    """`amount` with exactly AMOUNT_SCALE places, never in exponent form ("0.000000000", not "0E-9")."""
    return format(Decimal(amount).quantize(Decimal(1).scaleb(-AMOUNT_SCALE)), "f")


def utcnow() -> datetime:
    """Current time as an aware UTC datetime, the form every table stores and returns."""
    return datetime.now(UTC)


def _hex(value: Any) -> Any:
    return value.hex() if isinstance(value, bytes | bytearray | memoryview) else value


# --- contributors -------------------------------------------------------------------------------


class ContributorBase(SQLModel):
    name: str
    status: str = "active"


class ContributorCreate(ContributorBase):
    contributor_id: str
    public_key: bytes


class Contributor(ContributorCreate, table=True):
    __tablename__ = "contributors"

    contributor_id: str = Field(primary_key=True)
    public_key: bytes = Field(sa_type=LargeBinary, nullable=False)
    status_reason: str | None = None
    reputation: float = 0.0
    created_at: datetime = Field(default_factory=utcnow)


class ContributorPublic(ContributorBase):
    contributor_id: str
    public_key: str
    status_reason: str | None
    reputation: float
    created_at: datetime

    @field_validator("public_key", mode="before")
    @classmethod
    def _public_key_hex(cls, value: Any) -> Any:
        return _hex(value)


# --- rounds -------------------------------------------------------------------------------------


class RoundBase(SQLModel):
    number: int
    base_version: str
    seed: int
    aggregator: str
    codec: str


class RoundCreate(RoundBase):
    pass


class Round(RoundCreate, table=True):
    __tablename__ = "rounds"

    number: int = Field(primary_key=True, sa_column_kwargs={"autoincrement": False})
    seed: int = Field(sa_type=BigInteger)
    status: str = "open"
    opened_at: datetime = Field(default_factory=utcnow)
    closed_at: datetime | None = None
    new_version: str | None = None
    metrics: dict[str, Any] = Field(default_factory=dict, sa_type=JSON)


class RoundPublic(RoundBase):
    status: str
    opened_at: datetime
    closed_at: datetime | None
    new_version: str | None
    metrics: dict[str, Any]


# --- submissions --------------------------------------------------------------------------------


@dataclass(frozen=True)
class AggregationDecision:
    """What the aggregator did with one accepted submission (see `record_aggregations`)."""

    submission_id: int
    selected: bool
    weight: float
    trimmed_share: float
    score: float | None
    reason: str


@dataclass(frozen=True)
class DpMechanism:
    """The DP-SGD a submission states it ran: `steps` subsampled Gaussian steps at noise
    multiplier sigma and sample rate q, accounted for `delta` with `accountant` (rdp or prv)."""

    noise_multiplier: float
    sample_rate: float
    steps: int
    delta: float
    accountant: str


class SubmissionBase(SQLModel):
    round_number: int = Field(index=True)
    contributor_id: str = Field(index=True)
    nonce: str
    base_version: str
    payload_sha256: str
    size_bytes: int = Field(sa_type=BigInteger)
    decision: str
    reason: str
    epsilon: float | None = None
    # the DP-SGD mechanism the contributor states it ran (absent when the round was not private);
    # the coordinator composes a contributor's rounds from these (zoo_gym.privacy.accounting)
    dp_noise_multiplier: float | None = None
    dp_sample_rate: float | None = None
    dp_steps: int | None = None
    dp_delta: float | None = None
    dp_accountant: str | None = None


class SubmissionCreate(SubmissionBase):
    pass


class Submission(SubmissionCreate, table=True):
    """One received update and what the coordinator decided about it.

    No foreign keys to rounds or contributors: a submission naming an unknown round is still
    recorded (as rejected, with its reason).
    """

    __tablename__ = "submissions"
    __table_args__ = (
        UniqueConstraint("contributor_id", "nonce", name="uq_submissions_contributor_nonce"),
        Index(
            "uq_submissions_accepted_round_contributor",
            "round_number",
            "contributor_id",
            unique=True,
            sqlite_where=text("decision = 'accepted'"),
            postgresql_where=text("decision = 'accepted'"),
        ),
    )

    id: int | None = Field(default=None, primary_key=True)
    received_at: datetime = Field(default_factory=utcnow)
    selected: bool | None = None
    weight: float | None = None
    trimmed_share: float | None = None
    score: float | None = None
    aggregation_reason: str | None = None
    quality: float | None = None
    reward: Decimal | None = Field(default=None, sa_type=Numeric(AMOUNT_DIGITS, AMOUNT_SCALE))

    @property
    def dp_mechanism(self) -> DpMechanism | None:
        """The DP-SGD this submission states it ran, or None (not private, or not stated)."""
        sigma, q, steps, delta = (
            self.dp_noise_multiplier,
            self.dp_sample_rate,
            self.dp_steps,
            self.dp_delta,
        )
        if sigma is None or q is None or steps is None or delta is None:
            return None
        return DpMechanism(sigma, q, steps, delta, self.dp_accountant or "rdp")


class SubmissionPublic(SubmissionBase):
    id: int
    received_at: datetime
    selected: bool | None
    weight: float | None
    trimmed_share: float | None
    score: float | None
    aggregation_reason: str | None
    quality: float | None
    reward: Decimal | None

    @field_serializer("reward")
    def _fixed(self, reward: Decimal | None) -> str | None:
        return None if reward is None else fixed_amount(reward)


# --- rewards ------------------------------------------------------------------------------------


class RewardBase(SQLModel):
    """One contributor's payment for one round: an exact decimal amount (zero with its reason)."""

    round_number: int = Field(foreign_key="rounds.number", index=True)
    contributor_id: str = Field(foreign_key="contributors.contributor_id", index=True)
    quality: float | None
    amount: Decimal = Field(sa_type=Numeric(AMOUNT_DIGITS, AMOUNT_SCALE))
    reputation_after: float
    reason: str = ""


class RewardCreate(RewardBase):
    pass


class Reward(RewardCreate, table=True):
    __tablename__ = "rewards"
    __table_args__ = (
        UniqueConstraint("round_number", "contributor_id", name="uq_rewards_round_contributor"),
    )

    id: int | None = Field(default=None, primary_key=True)
    recorded_at: datetime = Field(default_factory=utcnow)


class RewardPublic(RewardBase):
    id: int
    recorded_at: datetime

    @field_serializer("amount")
    def _fixed(self, amount: Decimal) -> str:
        return fixed_amount(amount)


# --- model versions -----------------------------------------------------------------------------


class ModelVersionBase(SQLModel):
    version: str
    parent: str | None = None
    round_number: int | None = None
    manifest_sha256: str
    path: str
    metrics: dict[str, Any] = Field(default_factory=dict, sa_type=JSON)


class ModelVersionCreate(ModelVersionBase):
    pass


class ModelVersion(ModelVersionCreate, table=True):
    __tablename__ = "model_versions"

    version: str = Field(primary_key=True)
    published_at: datetime = Field(default_factory=utcnow)


class ModelVersionPublic(ModelVersionBase):
    published_at: datetime


# --- audit events -------------------------------------------------------------------------------


class AuditEventBase(SQLModel):
    actor: str
    action: str
    target: str
    detail: dict[str, Any] = Field(default_factory=dict, sa_type=JSON)


class AuditEventCreate(AuditEventBase):
    pass


class AuditEvent(AuditEventCreate, table=True):
    __tablename__ = "audit_events"

    id: int | None = Field(default=None, primary_key=True)
    at: datetime = Field(default_factory=utcnow)


class AuditEventPublic(AuditEventBase):
    id: int
    at: datetime


# --- Merkle log ---------------------------------------------------------------------------------


class LogEntryBase(SQLModel):
    index: int
    kind: str


class LogEntryCreate(LogEntryBase):
    record: bytes


class LogEntry(LogEntryCreate, table=True):
    """Leaf `index` of the Merkle log: canonical JSON `record` and its RFC 9162 leaf hash."""

    __tablename__ = "log_entries"

    index: int = Field(primary_key=True, sa_column_kwargs={"autoincrement": False})
    record: bytes = Field(sa_type=LargeBinary, nullable=False)
    leaf_hash: bytes = Field(sa_type=LargeBinary, nullable=False)


class LogEntryPublic(LogEntryBase):
    record: str
    leaf_hash: str

    @field_validator("record", mode="before")
    @classmethod
    def _decode_record(cls, value: Any) -> Any:
        return bytes(value).decode() if isinstance(value, bytes | memoryview) else value

    @field_validator("leaf_hash", mode="before")
    @classmethod
    def _leaf_hash_hex(cls, value: Any) -> Any:
        return _hex(value)


class CheckpointBase(SQLModel):
    size: int
    root: str
    signature: str
    signed_at: datetime


class CheckpointCreate(CheckpointBase):
    pass


class Checkpoint(CheckpointCreate, table=True):
    """A signed tree head: Ed25519 signature over canonical {"v", "size", "root", "signed_at"}."""

    __tablename__ = "checkpoints"

    id: int | None = Field(default=None, primary_key=True)


class CheckpointPublic(CheckpointBase):
    id: int


# --- API keys -----------------------------------------------------------------------------------

ApiRole = Literal["admin", "viewer"]
API_ROLES: frozenset[str] = frozenset({"admin", "viewer"})


class ApiKeyBase(SQLModel):
    name: str
    role: str


class ApiKeyCreate(ApiKeyBase):
    prefix: str
    secret_sha256: str


class ApiKey(ApiKeyCreate, table=True):
    """An operator's REST API key: only the SHA-256 of the token is stored, never the token.

    `prefix` is the short random part of the token that finds the row without the secret.
    Keys are operational state, not part of the Merkle log; creating and revoking one appends
    an audit event to the log (`zoo_gym.ledger.apikeys`).
    """

    __tablename__ = "api_keys"
    __table_args__ = (UniqueConstraint("prefix", name="uq_api_keys_prefix"),)

    id: int | None = Field(default=None, primary_key=True)
    created_at: datetime = Field(default_factory=utcnow)
    revoked_at: datetime | None = None


class ApiKeyPublic(ApiKeyBase):
    id: int
    prefix: str
    created_at: datetime
    revoked_at: datetime | None


# --- invitations --------------------------------------------------------------------------------


class InviteBase(SQLModel):
    note: str
    max_uses: int
    expires_at: datetime


class InviteCreate(InviteBase):
    prefix: str
    secret_sha256: str
    created_by: str


class Invite(InviteCreate, table=True):
    """An invitation code for `admission = "invite"`: only the SHA-256 of the code is stored.

    `prefix` is the short random part of the code that finds the row without the secret. A code
    admits up to `max_uses` new keys until `expires_at` or until it is revoked. Like API keys,
    invitations are operational state, not part of the Merkle log; creating, using and revoking
    one appends an audit event to the log (`zoo_gym.ledger.invites`).
    """

    __tablename__ = "invites"
    __table_args__ = (UniqueConstraint("prefix", name="uq_invites_prefix"),)

    id: int | None = Field(default=None, primary_key=True)
    uses: int = 0
    created_at: datetime = Field(default_factory=utcnow)
    revoked_at: datetime | None = None


class InvitePublic(InviteBase):
    id: int
    prefix: str
    uses: int
    created_by: str
    created_at: datetime
    revoked_at: datetime | None


LEDGER_TABLES: tuple[type[SQLModel], ...] = (
    Contributor,
    Round,
    Submission,
    Reward,
    ModelVersion,
    AuditEvent,
    LogEntry,
    Checkpoint,
    ApiKey,
    Invite,
)
