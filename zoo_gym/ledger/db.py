"""Opening the ledger database and bringing its schema to the latest migration.

SQLite (one file, WAL journal, foreign keys on, 30 s busy timeout) is the embedded default;
PostgreSQL is selected by URL (``postgresql+psycopg://user@host/db``). Writers are serialised
(`zoo_gym.ledger.log.lock_log`): on SQLite a write transaction begins with BEGIN IMMEDIATE, so
writers queue on the database lock (up to the busy timeout) instead of failing half way, while
readers keep deferred transactions and never block writers under WAL; on PostgreSQL writers queue
on a transaction-level advisory lock.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import SQLAlchemyError

MIGRATIONS = Path(__file__).with_name("migrations")
BUSY_TIMEOUT_MS = 30_000
MIGRATION_LOCK_KEY = 0x7A6F6F6D6967  # "zoomig"
IMMEDIATE = "zoo_gym_ledger_immediate"
"""Connection execution option: on SQLite, begin the next transaction with BEGIN IMMEDIATE."""

DatabaseError = SQLAlchemyError
"""What opening or using the database raises when the database itself fails (unreachable server,
bad credentials, a locked or unreadable file): SQLAlchemy's base error."""


def sqlite_file(url: str) -> Path | None:
    """The database file of a SQLite `url` (relative paths as given); None for another backend."""
    parsed = make_url(url)
    return Path(parsed.database or "") if parsed.get_backend_name() == "sqlite" else None


def printable_url(url: str) -> str:
    """`url` for messages and logs: its password, if any, is hidden."""
    return make_url(url).render_as_string(hide_password=True)


def _sqlite_engine(url: str) -> Engine:
    database = make_url(url).database
    if not database or database == ":memory:":
        raise ValueError(f"{url}: the ledger needs a SQLite file, e.g. sqlite:///ledger.db")
    Path(database).parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(
        url, connect_args={"check_same_thread": False, "timeout": BUSY_TIMEOUT_MS / 1000}
    )

    @event.listens_for(engine, "connect")
    def _configure(dbapi_connection: Any, _record: Any) -> None:
        # Let SQLAlchemy's "begin" event issue BEGIN itself (pysqlite's own BEGIN is deferred).
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _begin(connection: Any) -> None:
        immediate = connection.get_execution_options().get(IMMEDIATE, False)
        connection.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")

    return engine


def create_ledger_engine(url: str) -> Engine:
    """An engine for `url` configured for the ledger, without touching the schema."""
    if make_url(url).get_backend_name() == "sqlite":
        return _sqlite_engine(url)
    return create_engine(url, pool_pre_ping=True)


def alembic_config() -> Config:
    """Alembic configuration pointing at the migrations shipped inside this package."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    return config


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Run the package's migrations up to `revision` in one transaction."""
    config = alembic_config()
    with engine.connect().execution_options(**{IMMEDIATE: True}) as connection, connection.begin():
        if connection.dialect.name == "postgresql":
            connection.execute(
                text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK_KEY}
            )
        config.attributes["connection"] = connection
        command.upgrade(config, revision)


def open_database(url: str) -> Engine:
    """Engine for the ledger at `url`, its schema at the latest migration.

    `url` is ``sqlite:///path/to/ledger.db`` or ``postgresql+psycopg://user:pw@host:port/db``.
    """
    engine = create_ledger_engine(url)
    upgrade(engine)
    return engine
