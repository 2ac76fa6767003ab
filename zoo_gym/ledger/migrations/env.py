"""Alembic environment: runs on the connection `zoo_gym.ledger.db.upgrade` passes in."""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection, create_engine
from sqlmodel import SQLModel

import zoo_gym.ledger.models  # noqa: F401  (registers the ledger tables)

target_metadata = SQLModel.metadata


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


connection = context.config.attributes.get("connection")
if connection is not None:
    _run(connection)
else:
    url = context.config.get_main_option("sqlalchemy.url")
    if not url:
        raise RuntimeError("set sqlalchemy.url or pass a connection in config.attributes")
    with create_engine(url).begin() as fresh:
        _run(fresh)
