"""Exact reward amounts and the reason for each: rewards.amount and submissions.reward become
NUMERIC(38, 9); rewards gain `reason`; rewards.quality may be empty (a rejected update has none).

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-21
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

AMOUNT = sa.Numeric(38, 9)


def upgrade() -> None:
    with op.batch_alter_table("rewards") as batch:
        batch.alter_column(
            "amount", type_=AMOUNT, existing_type=sa.Float(), existing_nullable=False
        )
        batch.alter_column("quality", existing_type=sa.Float(), nullable=True)
        batch.add_column(sa.Column("reason", sa.String(), nullable=False, server_default=""))
    with op.batch_alter_table("submissions") as batch:
        batch.alter_column("reward", type_=AMOUNT, existing_type=sa.Float(), existing_nullable=True)


def downgrade() -> None:
    with op.batch_alter_table("submissions") as batch:
        batch.alter_column("reward", type_=sa.Float(), existing_type=AMOUNT, existing_nullable=True)
    with op.batch_alter_table("rewards") as batch:
        batch.drop_column("reason")
        batch.alter_column("quality", existing_type=sa.Float(), nullable=False)
        batch.alter_column(
            "amount", type_=sa.Float(), existing_type=AMOUNT, existing_nullable=False
        )
