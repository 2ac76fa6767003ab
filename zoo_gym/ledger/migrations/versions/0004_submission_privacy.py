"""The DP-SGD mechanism each submission states (sigma, sample rate, steps, delta, accountant), so a
contributor's privacy over many rounds is composed by an accountant instead of summed (when every
one of its private rounds states its mechanism).

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-21
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COLUMNS = (
    ("dp_noise_multiplier", sa.Float()),
    ("dp_sample_rate", sa.Float()),
    ("dp_steps", sa.Integer()),
    ("dp_delta", sa.Float()),
    ("dp_accountant", sa.String()),
)


def upgrade() -> None:
    with op.batch_alter_table("submissions") as batch:
        for name, type_ in COLUMNS:
            batch.add_column(sa.Column(name, type_, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("submissions") as batch:
        for name, _ in reversed(COLUMNS):
            batch.drop_column(name)
