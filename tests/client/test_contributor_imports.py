"""A contributor's install never loads the coordinator's database stack: `gym-client` (every
command, `rewards --verify` included) checks Merkle proofs and signed checkpoints with pure code
from `zoo_gym.core`, so SQLAlchemy, SQLModel and Alembic are never imported on its machine."""

from __future__ import annotations

import subprocess
import sys

SQL_STACK = ("sqlalchemy", "sqlmodel", "alembic", "zoo_gym.ledger")


def loaded_by(module: str) -> list[str]:
    """The SQL-stack modules a fresh interpreter holds after importing `module`."""
    probe = (
        f"import sys, {module}\n"
        f"print(' '.join(sorted(m for m in sys.modules if m.startswith({SQL_STACK!r}))))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120
    )
    return done.stdout.split()


def test_the_contributor_cli_loads_no_sql_stack() -> None:
    assert loaded_by("zoo_gym.cli.client") == []


def test_reward_reports_verify_without_the_ledger_package() -> None:
    assert loaded_by("zoo_gym.client.report") == []


def test_the_probe_sees_the_stack_where_it_is_loaded() -> None:
    assert "sqlmodel" in loaded_by("zoo_gym.ledger")
