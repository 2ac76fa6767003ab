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


def test_a_ledger_written_before_0004_still_verifies_after_upgrading(database_url: str) -> None:
    """0004 adds the submissions' DP columns. A submission logged before it has no such fields
    in its log record; after the upgrade its row holds NULLs there and the log still verifies."""
    import json

    from sqlmodel import Session, col, select

    from zoo_gym.core import merkle
    from zoo_gym.core.hashing import canonical_json
    from zoo_gym.core.identity import Identity
    from zoo_gym.ledger import LogEntry, checkpoint, verify_ledger
    from zoo_gym.ledger import repository as repo

    signer = Identity.generate()
    engine = create_ledger_engine(database_url)
    upgrade(engine)
    with Session(engine) as session:
        repo.open_round(
            session, number=1, base_version="v0000", seed=1, aggregator="fedavg", codec="bd"
        )
        repo.record_submission(
            session,
            round_number=1,
            contributor_id="c" * 64,
            nonce="n1",
            base_version="v0000",
            payload_sha256="ab" * 32,
            size_bytes=10,
            decision="accepted",
            reason="accepted at intake",
            epsilon=1.5,
        )
        # what the code before 0004 wrote: the same record without the DP fields
        entry = session.exec(select(LogEntry).where(col(LogEntry.kind) == "submission")).one()
        record = json.loads(entry.record)
        fields = record["rows"][0]["fields"]
        for name in (
            "dp_noise_multiplier",
            "dp_sample_rate",
            "dp_steps",
            "dp_delta",
            "dp_accountant",
        ):
            del fields[name]
        entry.record = canonical_json(record)
        entry.leaf_hash = merkle.leaf_hash(entry.record)
        session.add(entry)
        session.commit()
    config = alembic_config()
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        command.downgrade(config, "0003")
    assert "dp_steps" not in {c["name"] for c in inspect(engine).get_columns("submissions")}

    upgrade(engine)  # what `serve` does on start
    with Session(engine) as session:
        checkpoint(session, signer=signer)
        report = verify_ledger(session, public_key=signer.public_key)
        [row] = repo.list_submissions(session, round_number=1)
    assert report.ok, report.problems
    assert row.epsilon == 1.5 and row.dp_mechanism is None
    engine.dispose()
