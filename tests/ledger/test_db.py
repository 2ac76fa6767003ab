"""open_database: SQLite settings for the embedded default, URLs it refuses."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import text
from sqlmodel import Session

from zoo_gym.ledger import open_database
from zoo_gym.ledger import repository as repo
from zoo_gym.ledger.db import printable_url, sqlite_file


def test_sqlite_runs_wal_with_foreign_keys_and_busy_timeout(tmp_path: Path) -> None:
    engine = open_database(f"sqlite:///{tmp_path / 'nested' / 'ledger.db'}")
    with engine.connect() as connection:
        pragma = {
            name: connection.execute(text(f"PRAGMA {name}")).scalar()
            for name in ("journal_mode", "foreign_keys", "busy_timeout")
        }
    assert pragma == {"journal_mode": "wal", "foreign_keys": 1, "busy_timeout": 30000}
    with Session(engine) as session, pytest.raises(repo.NotFound):
        repo.record_reward(
            session, round_number=1, contributor_id="x", quality=0, amount=0, reputation_after=0
        )
    engine.dispose()


def test_in_memory_sqlite_is_refused() -> None:
    with pytest.raises(ValueError, match="SQLite file"):
        open_database("sqlite://")


def test_a_read_transaction_does_not_block_writers(tmp_path: Path) -> None:
    engine = open_database(f"sqlite:///{tmp_path / 'ledger.db'}")
    with Session(engine) as reader, Session(engine) as writer:
        assert repo.list_rounds(reader) == []  # leaves a read transaction open
        repo.open_round(writer, number=1, base_version="v0", seed=1, aggregator="m", codec="c")
        repo.open_round(reader, number=2, base_version="v0", seed=1, aggregator="m", codec="c")
    with Session(engine) as session:
        assert [r.number for r in repo.list_rounds(session)] == [1, 2]
    engine.dispose()


def test_url_helpers_name_the_sqlite_file_and_hide_passwords() -> None:
    assert sqlite_file("sqlite:///runs/ledger.db") == Path("runs/ledger.db")
    assert sqlite_file("sqlite:////srv/ledger.db") == Path("/srv/ledger.db")
    assert sqlite_file("postgresql+psycopg://zoo:secret@db:5432/ledger") is None
    assert printable_url("postgresql+psycopg://zoo:secret@db:5432/ledger") == (
        "postgresql+psycopg://zoo:***@db:5432/ledger"
    )
    assert printable_url("sqlite:///runs/ledger.db") == "sqlite:///runs/ledger.db"
