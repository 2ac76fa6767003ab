"""Benchmark: ledger append throughput, proofs, checkpoints and verification at 10^5 and 10^6 entries.

Runs the real ledger (`zoo_gym.ledger`) on SQLite (a file in a temporary directory, WAL, as
`open_database("sqlite:///...")` configures it) and on PostgreSQL (a throwaway cluster started
here from the machine's server binaries, e.g. Debian's /usr/lib/postgresql/<major>/bin: initdb
into a temporary directory, a free port on 127.0.0.1, its unix socket in that directory, default
durability settings; stopped by the postmaster's PID and deleted at the end, also on error).

Two ways entries get into the log, and every figure says which one produced it:

- production path: one repository call per entry, each in its own `Session` and transaction, as
  the coordinator does: `record_audit(...)` (one audit row) and `record_submission(...)`
  (an accepted submission: replay and duplicate checks, one submission row). Each call takes the
  append lock, inserts its row, appends one Merkle log entry (`append_entry`), commits and
  refreshes the row. Timed in batches; the rate is the median over batches.
- bulk fill: what `record_audit` writes, built with the ledger's own `build_record` and
  `merkle.leaf_hash` (the leaf computation of `append_entry`), inserted as multi-row INSERTs of
  `--fill-batch` audit rows and log entries per transaction. It only brings the log to the next
  size quickly; its rate is the anchor the production rate is compared with.

At each size S the log is bulk-filled to S - `--appends-at-size`, then production appends bring
it to exactly S (the "appends/s at size" figure), and then at size S:

- `get_inclusion_proof(index, tree_size=S)` and `get_consistency_proof(old, S)`: median over
  `--repeats` random indices / old sizes; split into reading the leaf hashes (`leaf_hashes`) and
  the Merkle work on them, and compared with the same proof from leaves already in memory;
- `checkpoint(signer)`: sign the tree head (median of `--repeats`);
- `verify_ledger(public_key)`: replay the whole log and every row once (`--no-verify` skips it).
  A report that is not ok is printed and the run goes on.

    python bench/ledger.py                                  # 10^5 and 10^6, SQLite and PostgreSQL
    python bench/ledger.py --quick                          # 10^3 and 10^4, a smoke run
    python bench/ledger.py --sizes 100000 --backends sqlite
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pwd
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, func, insert, text
from sqlmodel import Session, select

from zoo_gym import ledger
from zoo_gym.core import merkle
from zoo_gym.core.identity import Identity
from zoo_gym.ledger.log import leaf_hashes, lock_log, log_size
from zoo_gym.ledger.models import AuditEvent, LogEntry, utcnow
from zoo_gym.ledger.records import build_record

PRODUCTION_BATCH = 100
AUDIT_COLUMNS = ("id", "actor", "action", "target", "detail", "at")


# --- PostgreSQL throwaway cluster ---------------------------------------------------------------


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
    """PostgreSQL refuses to run as root: run it as `postgres` (or `nobody`) when we are root."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        with contextlib.suppress(KeyError):
            pwd.getpwnam(name)
            return name
    raise RuntimeError("running as root and no unprivileged user (postgres, nobody) for PostgreSQL")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def postgres_database() -> Iterator[str]:
    """URL of a fresh database in a throwaway cluster; the cluster is stopped and deleted after."""
    import psycopg

    bin_dir = find_pg_bin()
    if bin_dir is None:
        raise RuntimeError("PostgreSQL binaries not found: apt-get install postgresql")
    user = _server_user()
    root = Path(tempfile.mkdtemp(prefix="zoo-bench-pg-"))
    if user is not None:
        entry = pwd.getpwnam(user)
        os.chown(root, entry.pw_uid, entry.pw_gid)
    data = root / "data"
    port = _free_port()

    def run(*args: str) -> None:
        subprocess.run(args, check=True, capture_output=True, user=user, cwd=root)

    try:
        run(str(bin_dir / "initdb"), "-D", str(data), "-U", "postgres", "-A", "trust", "-E", "UTF8")
        options = f"-p {port} -k {root} -c listen_addresses=127.0.0.1"
        log = str(root / "server.log")
        run(str(bin_dir / "pg_ctl"), "-D", str(data), "-l", log, "-o", options, "-w", "start")
        dsn = f"host=127.0.0.1 port={port} user=postgres dbname=postgres"
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE DATABASE ledger_bench")
        yield f"postgresql+psycopg://postgres@127.0.0.1:{port}/ledger_bench"
    finally:
        _stop_postmaster(data)
        shutil.rmtree(root, ignore_errors=True)


def _stop_postmaster(data: Path) -> None:
    """Stop the cluster's postmaster by the PID in postmaster.pid: fast shutdown, then SIGKILL."""
    pid_file = data / "postmaster.pid"
    if not pid_file.exists():
        return
    pid = int(pid_file.read_text().split()[0])
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGINT)  # "fast" shutdown: roll back, disconnect, exit
        for _ in range(300):  # the postmaster removes its pid file as it exits
            if not pid_file.exists():
                return
            time.sleep(0.1)
        os.kill(pid, signal.SIGKILL)


# --- appending ----------------------------------------------------------------------------------


@dataclass
class Appender:
    """Production-path appends through the repository functions, one session per call."""

    engine: Engine
    serial: int = 0

    def audit(self) -> None:
        self.serial += 1
        with Session(self.engine) as session:
            ledger.record_audit(
                session,
                actor="bench",
                action="bench.append",
                target=f"target-{self.serial}",
                detail={"serial": self.serial},
            )

    def submission(self) -> None:
        self.serial += 1
        with Session(self.engine) as session:
            ledger.record_submission(
                session,
                round_number=1,
                contributor_id=f"contributor-{self.serial}",
                nonce=f"nonce-{self.serial}",
                base_version="v0000",
                payload_sha256=f"{self.serial:064x}",
                size_bytes=14_336,
                decision="accepted",
                reason="ok",
                epsilon=2.5,
            )


@dataclass(frozen=True)
class Rate:
    """Median batch rate (calls per second) and this process's CPU time per call (seconds)."""

    per_second: float
    cpu: float


def timed_batches(call: Callable[[], None], count: int, batch: int = PRODUCTION_BATCH) -> Rate:
    """Run `call` `count` times in timed batches of `batch`."""
    rates = []
    done = 0
    cpu_start = time.process_time()
    while done < count:
        k = min(batch, count - done)
        start = time.perf_counter()
        for _ in range(k):
            call()
        rates.append(k / (time.perf_counter() - start))
        done += k
    return Rate(statistics.median(rates), (time.process_time() - cpu_start) / count)


def bulk_fill(engine: Engine, count: int, *, batch: int) -> float:
    """Append `count` audit entries, `batch` rows per transaction; returns entries per second.

    Rows and log entries are exactly what `record_audit` writes: the audit row (explicit id, the
    next one the table would assign) and log entry i with record `build_record(i, "audit",
    [(row, None)])` and leaf hash `merkle.leaf_hash(record)`.
    """
    start = time.perf_counter()
    done = 0
    while done < count:
        k = min(batch, count - done)
        with Session(engine) as session:
            lock_log(session)
            index = log_size(session)
            next_id = (session.exec(select(func.max(AuditEvent.id))).one() or 0) + 1
            rows, entries = [], []
            for j in range(k):
                event = AuditEvent(
                    id=next_id + j,
                    actor="bench",
                    action="bench.fill",
                    target=f"target-fill-{index + j}",
                    detail={"serial": index + j},
                    at=utcnow(),
                )
                record = build_record(index + j, "audit", [(event, None)])
                rows.append({c: getattr(event, c) for c in AUDIT_COLUMNS})
                entries.append(
                    {
                        "index": index + j,
                        "kind": "audit",
                        "record": record,
                        "leaf_hash": merkle.leaf_hash(record),
                    }
                )
            session.execute(insert(AuditEvent.__table__), rows)  # type: ignore[attr-defined]
            session.execute(insert(LogEntry.__table__), entries)  # type: ignore[attr-defined]
            if engine.dialect.name == "postgresql":  # explicit ids do not advance the sequence
                session.execute(
                    text(
                        "SELECT setval(pg_get_serial_sequence('audit_events', 'id'), "
                        "(SELECT max(id) FROM audit_events))"
                    )
                )
            session.commit()
        done += k
    return count / (time.perf_counter() - start)


# --- reads at a size ----------------------------------------------------------------------------


@dataclass
class AtSize:
    """Timings (seconds) at one log size."""

    size: int
    append_rate: Rate
    inclusion: float
    inclusion_read: float
    inclusion_memory: float
    consistency: float
    consistency_memory: float
    checkpoint: float
    verify: float | None
    verify_ok: bool | None


def _median_over(call: Callable[[int], object], arguments: list[int]) -> float:
    """Median wall time of `call(a)` over the `arguments`."""
    times = []
    for a in arguments:
        start = time.perf_counter()
        call(a)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _in_memory_inclusion(leaves: list[bytes], index: int) -> None:
    """What `get_inclusion_proof` computes once the leaf hashes are read: the path and the root."""
    merkle.inclusion_proof(index, leaves)
    merkle.root(leaves)


def _in_memory_consistency(leaves: list[bytes], old: int) -> None:
    """What `get_consistency_proof` computes once the leaf hashes are read."""
    merkle.consistency_proof(old, leaves)
    merkle.root(leaves[:old])
    merkle.root(leaves)


def _in_memory(leaves: list[bytes], indices: list[int], olds: list[int]) -> tuple[float, float]:
    """Median times of the inclusion and consistency proofs' Merkle work, leaves in memory."""
    return (
        _median_over(lambda i: _in_memory_inclusion(leaves, i), indices),
        _median_over(lambda m: _in_memory_consistency(leaves, m), olds),
    )


def measure_at_size(
    engine: Engine, signer: Identity, size: int, append_rate: Rate, *, repeats: int, verify: bool
) -> AtSize:
    rng = random.Random(size)
    indices = [rng.randrange(size) for _ in range(repeats)]
    olds = [rng.randrange(1, size) for _ in range(repeats)]
    with Session(engine) as session:
        assert log_size(session) == size, "the log is not at the size being measured"
        inclusion = _median_over(
            lambda i: ledger.get_inclusion_proof(session, index=i, tree_size=size), indices
        )
        consistency = _median_over(
            lambda m: ledger.get_consistency_proof(session, old_size=m, new_size=size), olds
        )
        proof = ledger.get_inclusion_proof(session, index=indices[0], tree_size=size)
        assert proof.verify(), "an inclusion proof did not verify"
        cproof = ledger.get_consistency_proof(session, old_size=olds[0], new_size=size)
        assert cproof.verify(), "a consistency proof did not verify"
        inclusion_read = _median_over(lambda _: leaf_hashes(session, size=size), indices)
        inclusion_memory, consistency_memory = _in_memory(
            leaf_hashes(session, size=size), indices, olds
        )
    with Session(engine) as session:
        head = _median_over(lambda _: ledger.checkpoint(session, signer=signer), indices)
    report_time: float | None = None
    ok: bool | None = None
    if verify:
        with Session(engine) as session:
            start = time.perf_counter()
            report = ledger.verify_ledger(session, public_key=signer.public_key)
            report_time = time.perf_counter() - start
        ok = report.ok
        if not report.ok:
            print(
                f"  verify_ledger at {size}: {len(report.problems)} problems, first: {report.first}"
            )
    return AtSize(
        size,
        append_rate,
        inclusion,
        inclusion_read,
        inclusion_memory,
        consistency,
        consistency_memory,
        head,
        report_time,
        ok,
    )


# --- one backend --------------------------------------------------------------------------------


@dataclass
class BackendResult:
    backend: str
    settings: str
    audit_rate: Rate = Rate(0.0, 0.0)
    submission_rate: Rate = Rate(0.0, 0.0)
    fill_rates: list[float] = field(default_factory=list)
    sizes: list[AtSize] = field(default_factory=list)


def _settings(engine: Engine) -> str:
    with engine.connect() as conn:
        if engine.dialect.name == "sqlite":
            mode = conn.exec_driver_sql("PRAGMA journal_mode").scalar()
            sync = conn.exec_driver_sql("PRAGMA synchronous").scalar()
            names = {0: "OFF", 1: "NORMAL", 2: "FULL", 3: "EXTRA"}
            return f"journal_mode={mode}, synchronous={names.get(int(sync or 0), sync)}"
        version = conn.exec_driver_sql("SHOW server_version").scalar()
        fsync = conn.exec_driver_sql("SHOW fsync").scalar()
        commit = conn.exec_driver_sql("SHOW synchronous_commit").scalar()
        return f"PostgreSQL {version}, fsync={fsync}, synchronous_commit={commit}"


def run_backend(
    name: str,
    url: str,
    sizes: list[int],
    *,
    production: int,
    at_size: int,
    args: argparse.Namespace,
) -> BackendResult:
    engine = ledger.open_database(url)
    try:
        result = BackendResult(name, _settings(engine))
        signer = Identity.generate()
        who = Identity.generate()
        with Session(engine) as session:
            ledger.register_contributor(
                session, contributor_id=who.contributor_id, public_key=who.public_key, name="bench"
            )
            ledger.open_round(
                session, number=1, base_version="v0000", seed=1, aggregator="fedavg", codec="none"
            )
        appender = Appender(engine)
        print(f"[{name}] {result.settings}", flush=True)
        result.audit_rate = timed_batches(appender.audit, production // 2)
        result.submission_rate = timed_batches(appender.submission, production - production // 2)
        print(
            f"[{name}] production path from an empty log: record_audit "
            f"{result.audit_rate.per_second:.0f}/s, "
            f"record_submission {result.submission_rate.per_second:.0f}/s",
            flush=True,
        )
        for size in sizes:
            with Session(engine) as session:
                current = log_size(session)
            fill = size - at_size - current
            if fill < 0:
                raise SystemExit(f"size {size} is below the {current + at_size} entries needed")
            if fill:
                rate = bulk_fill(engine, fill, batch=args.fill_batch)
                result.fill_rates.append(rate)
                print(f"[{name}] bulk fill of {fill} entries: {rate:.0f}/s", flush=True)
            rate = timed_batches(appender.audit, at_size)
            measured = measure_at_size(
                engine, signer, size, rate, repeats=args.repeats, verify=not args.no_verify
            )
            result.sizes.append(measured)
            print(f"[{name}] at {size}: {measured}", flush=True)
        return result
    finally:
        engine.dispose()


# --- report -------------------------------------------------------------------------------------


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:,.0f}" if seconds >= 0.01 else f"{seconds * 1000:.2f}"


def report(results: list[BackendResult], *, production: int, at_size: int) -> str:
    half = production // 2
    lines = [
        "### Appends (production path: one repository call per entry, each in its own session "
        "and transaction)",
        "",
        "| backend | path | log size while timed | entries timed | appends/s "
        "| ms/append | client CPU ms/append |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for r in results:
        rows = [
            ("production `record_audit`", f"0..{half}", half, r.audit_rate),
            (
                "production `record_submission`",
                f"{half}..{production}",
                production - half,
                r.submission_rate,
            ),
        ]
        rows += [
            (
                "production `record_audit`",
                f"{s.size - at_size:,}..{s.size:,}",
                at_size,
                s.append_rate,
            )
            for s in r.sizes
        ]
        for path, where, count, rate in rows:
            lines.append(
                f"| {r.backend} | {path} | {where} | {count} | {rate.per_second:,.0f} | "
                f"{1000 / rate.per_second:.2f} | {rate.cpu * 1000:.2f} |"
            )
        if r.fill_rates:
            fill = statistics.median(r.fill_rates)
            lines.append(
                f"| {r.backend} | bulk fill (anchor, not production): same rows, "
                f"multi-row INSERTs | up to each size | all others | {fill:,.0f} | "
                f"{1000 / fill:.3f} | - |"
            )
    lines += [
        "",
        "### At a log size (production functions, median of repeats; ms unless noted)",
        "",
        "| backend | entries | inclusion proof | of which reading leaf hashes | same proof from "
        "leaves in memory | consistency proof | from memory | signed checkpoint | "
        "verify_ledger (s) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        for s in r.sizes:
            if s.verify is None:
                verify = "skipped"
            else:
                verify = f"{s.verify:,.1f}" + ("" if s.verify_ok else " (NOT ok)")
            lines.append(
                f"| {r.backend} | {s.size:,} | {_ms(s.inclusion)} | {_ms(s.inclusion_read)} | "
                f"{_ms(s.inclusion_memory)} | {_ms(s.consistency)} | {_ms(s.consistency_memory)} | "
                f"{_ms(s.checkpoint)} | {verify} |"
            )
    lines += ["", "Ratios measured in this run:"]
    for r in results:
        if r.fill_rates:
            fill = statistics.median(r.fill_rates)
            lines.append(
                f"- {r.backend}: production `record_audit` on the empty log runs at "
                f"{r.audit_rate.per_second / fill:.3f}x the bulk-fill rate of the same rows"
            )
        for s in r.sizes:
            lines.append(
                f"- {r.backend} at {s.size:,}: inclusion proof "
                f"{s.inclusion / s.inclusion_memory:.2f}x the in-memory proof; "
                f"appends/s {s.append_rate.per_second / r.audit_rate.per_second:.2f}x "
                "the empty-log rate"
            )
    lines += ["", "Settings: " + "; ".join(f"{r.backend}: {r.settings}" for r in results)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="100000,1000000", help="log sizes, comma separated")
    parser.add_argument("--backends", default="sqlite,postgres", help="sqlite and/or postgres")
    parser.add_argument("--quick", action="store_true", help="sizes 10^3 and 10^4 (smoke run)")
    parser.add_argument(
        "--production",
        type=int,
        default=2000,
        help="production-path appends timed on the empty log (half audit, half submission)",
    )
    parser.add_argument(
        "--appends-at-size",
        type=int,
        default=500,
        help="production-path appends timed just below each size",
    )
    parser.add_argument("--fill-batch", type=int, default=20_000, help="bulk-fill rows per commit")
    parser.add_argument("--repeats", type=int, default=5, help="timings per median")
    parser.add_argument("--no-verify", action="store_true", help="skip verify_ledger")
    args = parser.parse_args(argv)
    sizes = [1_000, 10_000] if args.quick else [int(s) for s in args.sizes.split(",")]
    production, at_size = args.production, args.appends_at_size
    if args.quick:
        production, at_size = min(production, 400), min(at_size, 200)
    if sizes[0] < production + 2 + at_size:
        raise SystemExit(f"the smallest size must be at least {production + 2 + at_size}")
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = set(backends) - {"sqlite", "postgres"}
    if unknown:
        raise SystemExit(f"unknown backend(s) {', '.join(sorted(unknown))}: use sqlite, postgres")

    def _terminate(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)  # unwinds through the finally blocks that clean up

    signal.signal(signal.SIGTERM, _terminate)
    results = []
    for backend in backends:
        if backend == "sqlite":
            with tempfile.TemporaryDirectory(prefix="zoo-bench-sqlite-") as tmp:
                url = f"sqlite:///{Path(tmp) / 'ledger.db'}"
                results.append(
                    run_backend(
                        "SQLite", url, sizes, production=production, at_size=at_size, args=args
                    )
                )
        else:
            with postgres_database() as url:
                results.append(
                    run_backend(
                        "PostgreSQL", url, sizes, production=production, at_size=at_size, args=args
                    )
                )
    print()
    print(report(results, production=production, at_size=at_size))
    return 0


if __name__ == "__main__":
    sys.exit(main())
