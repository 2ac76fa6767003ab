"""The shipped Alembic migrations build exactly the schema the models describe."""

from __future__ import annotations

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, inspect
from sqlmodel import SQLModel

from zoo_gym.ledger.db import alembic_config, create_ledger_engine, upgrade
from zoo_gym.ledger.models import LEDGER_TABLES

TABLES = {model.__table__.name for model in LEDGER_TABLES}  # type: ignore[attr-defined]


def _include(
    obj: object, name: str | None, type_: str, reflected: bool, compare_to: object
) -> bool:
    return type_ != "table" or name in TABLES


def test_migrations_match_models(engine: Engine) -> None:
    with engine.connect() as connection:
        context = MigrationContext.configure(
            connection, opts={"compare_type": True, "include_object": _include}
        )
        diff = compare_metadata(context, SQLModel.metadata)
    assert diff == []


def test_database_is_at_head(engine: Engine) -> None:
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    with engine.connect() as connection:
        assert MigrationContext.configure(connection).get_current_revision() == head
    assert set(inspect(engine).get_table_names()) >= TABLES


def test_downgrade_and_upgrade_again(database_url: str) -> None:
    engine = create_ledger_engine(database_url)
    upgrade(engine)
    config = alembic_config()
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        command.downgrade(config, "base")
    assert not TABLES & set(inspect(engine).get_table_names())
    upgrade(engine)
    assert set(inspect(engine).get_table_names()) >= TABLES
    engine.dispose()
