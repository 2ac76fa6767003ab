"""Fixtures: every database test runs on SQLite (a file under tmp_path) and on PostgreSQL.

The PostgreSQL cluster is a throwaway one started here with the server binaries of the machine
(Debian: /usr/lib/postgresql/<major>/bin, package `postgresql`): initdb into a fresh directory, a
free port on 127.0.0.1, trust authentication, fsync off; one database per test; stopped and
deleted at the end of the run. PostgreSQL refuses to run as root, so as root the cluster is owned
by and run as the `postgres` user (or `nobody` when there is none).
"""

from __future__ import annotations

import itertools
import json
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from sqlalchemy import Engine
from sqlmodel import Session, col, select

from zoo_gym.core.identity import Identity
from zoo_gym.ledger import LogEntry, checkpoint, open_database
from zoo_gym.ledger import repository as repo

PG_MISSING = "PostgreSQL binaries not found: apt-get install postgresql"


def find_pg_bin() -> Path | None:
    """Directory holding initdb and pg_ctl: Debian's versioned directories first, then PATH."""
    candidates = sorted(
        Path("/usr/lib/postgresql").glob("*/bin"),
        key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0,
        reverse=True,
    )
    for directory in candidates:
        if (directory / "initdb").exists() and (directory / "pg_ctl").exists():
            return directory
    initdb = shutil.which("initdb")
    if initdb and shutil.which("pg_ctl"):
        return Path(initdb).parent
    return None


def _server_user() -> str | None:
    """Unprivileged user to run the server as when we are root; None to run as ourselves."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        try:
            pwd.getpwnam(name)
        except KeyError:
            continue
        return name
    raise RuntimeError(
        "running as root and no unprivileged user (postgres, nobody) to run PostgreSQL"
    )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class PostgresCluster:
    port: int
    counter: itertools.count[int]

    def url(self, database: str) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    def create_database(self) -> str:
        import psycopg

        name = f"ledger_{next(self.counter)}"
        with psycopg.connect(
            f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres", autocommit=True
        ) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.url(name)


@pytest.fixture(scope="session")
def postgres_cluster() -> Iterator[PostgresCluster]:
    bin_dir = find_pg_bin()
    if bin_dir is None:
        pytest.skip(PG_MISSING)
    user = _server_user()
    root = Path(tempfile.mkdtemp(prefix="zoo-ledger-pg-"))
    if user is not None:
        entry = pwd.getpwnam(user)
        os.chown(root, entry.pw_uid, entry.pw_gid)
    data, log = root / "data", root / "server.log"
    port = _free_port()

    def run(*args: str) -> None:
        subprocess.run(args, check=True, capture_output=True, user=user, cwd=root)

    run(
        str(bin_dir / "initdb"),
        "-D",
        str(data),
        "-U",
        "postgres",
        "-A",
        "trust",
        "-E",
        "UTF8",
        "--no-sync",
    )
    options = (
        f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off "
        "-c synchronous_commit=off -c full_page_writes=off"
    )
    run(str(bin_dir / "pg_ctl"), "-D", str(data), "-l", str(log), "-o", options, "-w", "start")
    try:
        yield PostgresCluster(port, itertools.count())
    finally:
        run(str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(
    params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)],
)
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'ledger.db'}"
    cluster: PostgresCluster = request.getfixturevalue("postgres_cluster")
    return cluster.create_database()


@pytest.fixture
def engine(database_url: str) -> Iterator[Engine]:
    engine = open_database(database_url)
    yield engine
    engine.dispose()


@pytest.fixture
def session(engine: Engine) -> Iterator[Session]:
    with Session(engine) as session:
        yield session


@dataclass
class Populated:
    """A small ledger: two contributors, one published round, rewards, a model, a checkpoint."""

    signer: Identity
    alice: str
    bob: str
    accepted_id: int
    rejected_id: int
    entries: dict[str, int]


def entry_index(session: Session, *, kind: str, table: str, key: object) -> int:
    """Index of the first log entry of `kind` that touches row `key` of `table`."""
    for entry in session.exec(select(LogEntry).order_by(col(LogEntry.index))):
        record = json.loads(entry.record)
        if record["kind"] == kind and any(
            row["table"] == table and row["key"] == key for row in record["rows"]
        ):
            return entry.index
    raise LookupError(f"no {kind} entry for {table} {key!r}")


@pytest.fixture
def populated(session: Session) -> Populated:
    signer = Identity.generate()
    alice, bob = Identity.generate(), Identity.generate()
    for who, name in ((alice, "alice"), (bob, "bob")):
        repo.register_contributor(
            session, contributor_id=who.contributor_id, public_key=who.public_key, name=name
        )
    repo.open_round(
        session, number=1, base_version="v0000", seed=7, aggregator="krum", codec="bitdelta"
    )
    accepted = repo.record_submission(
        session,
        round_number=1,
        contributor_id=alice.contributor_id,
        nonce="a-1",
        base_version="v0000",
        payload_sha256="aa" * 32,
        size_bytes=1234,
        decision="accepted",
        reason="ok",
        epsilon=2.5,
    )
    rejected = repo.record_submission(
        session,
        round_number=1,
        contributor_id=bob.contributor_id,
        nonce="b-1",
        base_version="v0000",
        payload_sha256="bb" * 32,
        size_bytes=99,
        decision="rejected",
        reason="non-finite values",
    )
    assert accepted.id is not None and rejected.id is not None
    repo.set_round_status(session, number=1, status="aggregating")
    repo.record_aggregation(
        session,
        submission_id=accepted.id,
        selected=True,
        weight=1.0,
        trimmed_share=0.0,
        score=0.25,
        reason="krum: lowest score",
    )
    repo.record_reward(
        session,
        round_number=1,
        contributor_id=alice.contributor_id,
        quality=0.125,
        amount=10,
        reputation_after=0.5,
    )
    repo.close_round(
        session, number=1, status="published", new_version="v0001", metrics={"loss": 1.5}
    )
    repo.record_model_version(
        session,
        version="v0001",
        parent="v0000",
        round_number=1,
        manifest_sha256="cc" * 32,
        path="models/v0001",
        metrics={"loss": 1.5},
    )
    repo.set_contributor_status(
        session, contributor_id=bob.contributor_id, status="banned", reason="spam", actor="op"
    )
    repo.record_audit(session, actor="op", action="policy.set", target="pool", detail={"pool": 100})
    checkpoint(session, signer=signer)
    entries = {
        "accepted": entry_index(session, kind="submission", table="submissions", key=accepted.id),
        "rejected": entry_index(session, kind="submission", table="submissions", key=rejected.id),
        "aggregation": entry_index(
            session, kind="aggregation", table="submissions", key=accepted.id
        ),
        "reward": entry_index(session, kind="reward", table="rewards", key=1),
        "model_version": entry_index(
            session, kind="model_version", table="model_versions", key="v0001"
        ),
    }
    return Populated(
        signer, alice.contributor_id, bob.contributor_id, accepted.id, rejected.id, entries
    )
