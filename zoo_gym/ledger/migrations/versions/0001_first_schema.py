"""First ledger schema: contributors, rounds, submissions, rewards, model versions, audit
events, and the Merkle log with its checkpoints.

Revision ID: 0001
Revises:
Create Date: 2026-11-21
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "audit_events",
        sa.Column("actor", sa.String(), nullable=False),
        sa.Column("action", sa.String(), nullable=False),
        sa.Column("target", sa.String(), nullable=False),
        sa.Column("detail", sa.JSON(), nullable=False),
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_table(
        "checkpoints",
        sa.Column("size", sa.Integer(), nullable=False),
        sa.Column("root", sa.String(), nullable=False),
        sa.Column("signature", sa.String(), nullable=False),
        sa.Column("signed_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("id", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_table(
        "contributors",
        sa.Column("name", sa.String(), nullable=False),
        sa.Column("status", sa.String(), nullable=False),
        sa.Column("contributor_id", sa.String(), nullable=False),
        sa.Column("public_key", sa.LargeBinary(), nullable=False),
        sa.Column("status_reason", sa.String(), nullable=True),
        sa.Column("reputation", sa.Float(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("contributor_id"),
    )
    op.create_table(
        "log_entries",
        sa.Column("index", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("kind", sa.String(), nullable=False),
        sa.Column("record", sa.LargeBinary(), nullable=False),
        sa.Column("leaf_hash", sa.LargeBinary(), nullable=False),
        sa.PrimaryKeyConstraint("index"),
    )
    op.create_table(
        "model_versions",
        sa.Column("version", sa.String(), nullable=False),
        sa.Column("parent", sa.String(), nullable=True),
        sa.Column("round_number", sa.Integer(), nullable=True),
        sa.Column("manifest_sha256", sa.String(), nullable=False),
        sa.Column("path", sa.String(), nullable=False),
        sa.Column("metrics", sa.JSON(), nullable=False),
        sa.Column("published_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("version"),
    )
    op.create_table(
        "rounds",
        sa.Column("number", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("base_version", sa.String(), nullable=False),
        sa.Column("seed", sa.BigInteger(), nullable=False),
        sa.Column("aggregator", sa.String(), nullable=False),
        sa.Column("codec", sa.String(), nullable=False),
        sa.Column("status", sa.String(), nullable=False),
        sa.Column("opened_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("closed_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("new_version", sa.String(), nullable=True),
        sa.Column("metrics", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("number"),
    )
    op.create_table(
        "submissions",
        sa.Column("round_number", sa.Integer(), nullable=False),
        sa.Column("contributor_id", sa.String(), nullable=False),
        sa.Column("nonce", sa.String(), nullable=False),
        sa.Column("base_version", sa.String(), nullable=False),
        sa.Column("payload_sha256", sa.String(), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("decision", sa.String(), nullable=False),
        sa.Column("reason", sa.String(), nullable=False),
        sa.Column("epsilon", sa.Float(), nullable=True),
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("received_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("selected", sa.Boolean(), nullable=True),
        sa.Column("weight", sa.Float(), nullable=True),
        sa.Column("trimmed_share", sa.Float(), nullable=True),
        sa.Column("score", sa.Float(), nullable=True),
        sa.Column("aggregation_reason", sa.String(), nullable=True),
        sa.Column("quality", sa.Float(), nullable=True),
        sa.Column("reward", sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("contributor_id", "nonce", name="uq_submissions_contributor_nonce"),
    )
    with op.batch_alter_table("submissions", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_submissions_contributor_id"), ["contributor_id"], unique=False
        )
        batch_op.create_index(
            batch_op.f("ix_submissions_round_number"), ["round_number"], unique=False
        )
        batch_op.create_index(
            "uq_submissions_accepted_round_contributor",
            ["round_number", "contributor_id"],
            unique=True,
            sqlite_where=sa.text("decision = 'accepted'"),
            postgresql_where=sa.text("decision = 'accepted'"),
        )

    op.create_table(
        "rewards",
        sa.Column("round_number", sa.Integer(), nullable=False),
        sa.Column("contributor_id", sa.String(), nullable=False),
        sa.Column("quality", sa.Float(), nullable=False),
        sa.Column("amount", sa.Float(), nullable=False),
        sa.Column("reputation_after", sa.Float(), nullable=False),
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("recorded_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["contributor_id"],
            ["contributors.contributor_id"],
        ),
        sa.ForeignKeyConstraint(
            ["round_number"],
            ["rounds.number"],
        ),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("round_number", "contributor_id", name="uq_rewards_round_contributor"),
    )
    with op.batch_alter_table("rewards", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_rewards_contributor_id"), ["contributor_id"], unique=False
        )
        batch_op.create_index(batch_op.f("ix_rewards_round_number"), ["round_number"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("rewards", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_rewards_round_number"))
        batch_op.drop_index(batch_op.f("ix_rewards_contributor_id"))

    op.drop_table("rewards")
    with op.batch_alter_table("submissions", schema=None) as batch_op:
        batch_op.drop_index(
            "uq_submissions_accepted_round_contributor",
            sqlite_where=sa.text("decision = 'accepted'"),
            postgresql_where=sa.text("decision = 'accepted'"),
        )
        batch_op.drop_index(batch_op.f("ix_submissions_round_number"))
        batch_op.drop_index(batch_op.f("ix_submissions_contributor_id"))

    op.drop_table("submissions")
    op.drop_table("rounds")
    op.drop_table("model_versions")
    op.drop_table("log_entries")
    op.drop_table("contributors")
    op.drop_table("checkpoints")
    op.drop_table("audit_events")
