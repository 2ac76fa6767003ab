"""Finding 4 against a real `gym-coordinator serve`: rolling the ledger back is caught outside it.

The attack, with write access to the database (sqlite3, no coordinator code): delete the newest
signed checkpoint, then rewrite an entry recorded after the one left (its record, its leaf hash
and its row, consistently). The database then agrees with itself, and once the coordinator signs
its next checkpoint, `gym-coordinator ledger verify` passes: a coordinator cannot check itself
against rollback. What catches it: the `checkpoint_copy` file kept outside the database (`ledger
verify --checkpoint FILE`) and a contributor that kept the newest checkpoint it verified
(`gym-client rewards --verify`).
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import httpx
import pytest
from serve_process import ServeProcess, serve
from sqlmodel import Session
from typer.testing import CliRunner, Result

from zoo_gym import ledger
from zoo_gym.cli.client import app as client_app
from zoo_gym.cli.coordinator import app as coordinator_app
from zoo_gym.client.state import LocalState
from zoo_gym.core import merkle
from zoo_gym.core.hashing import canonical_json
from zoo_gym.core.identity import Identity

pytestmark = pytest.mark.e2e


def pay_round(home: Path, alice: Identity, number: int, amount: str) -> None:
    """One published round paying alice, recorded with the functions the round loop uses."""
    engine = ledger.open_database(f"sqlite:///{home / 'ledger.db'}")
    with Session(engine) as s:
        if ledger.get_contributor(s, contributor_id=alice.contributor_id) is None:
            ledger.register_contributor(
                s, contributor_id=alice.contributor_id, public_key=alice.public_key, name="alice"
            )
        ledger.open_round(
            s, number=number, base_version="v0000", seed=number, aggregator="median", codec="bd"
        )
        ledger.record_submission(
            s,
            round_number=number,
            contributor_id=alice.contributor_id,
            nonce=f"n{number}",
            base_version="v0000",
            payload_sha256="ab" * 32,
            size_bytes=10,
            decision="accepted",
            reason="accepted at intake",
        )
        ledger.record_reward(
            s,
            round_number=number,
            contributor_id=alice.contributor_id,
            quality=0.25,
            amount=amount,
            reputation_after=0.2,
        )
        ledger.close_round(s, number=number, status="published", metrics={})
    engine.dispose()


def contributor(tmp_path: Path, coordinator_home: Path) -> tuple[Path, Identity]:
    """Alice's home: key, config and the coordinator key pinned at join."""
    home = tmp_path / "alice"
    made = CliRunner().invoke(client_app, ["init", "--home", str(home), "--name", "alice"])
    assert made.exit_code == 0, made.output
    alice = Identity.load(home / "client.key")
    signer = Identity.load(coordinator_home / "coordinator.key")
    state = home / "state" / "state.json"
    state.parent.mkdir(exist_ok=True)
    LocalState(state, "127.0.0.1:1", signer.public_key.hex(), alice.contributor_id).save()
    return home, alice


def admin_token(home: Path) -> str:
    argv = ["apikey", "create", "--name", "ops", "--role", "admin", "--format", "json"]
    made = CliRunner().invoke(coordinator_app, [*argv, "-c", str(home / "coordinator.toml")])
    assert made.exit_code == 0, made.output
    return str(json.loads(made.stdout)["token"])


def sign(served: ServeProcess, token: str) -> dict[str, object]:
    """What the round loop does at each round's end: sign the tree head (POST, as an admin)."""
    answer = httpx.post(
        f"{served.rest}/ledger/checkpoint", headers={"Authorization": f"Bearer {token}"}
    )
    assert answer.status_code == 201, answer.text
    return dict(answer.json())


def rewards_verify(served: ServeProcess, home: Path) -> Result:
    """`gym-client rewards --verify` (in this process; the coordinator is the real one)."""
    argv = ["rewards", "--home", str(home), "--api", served.rest, "--verify"]
    return CliRunner().invoke(client_app, argv, env={"COLUMNS": "200", "NO_COLOR": "1"})


def ledger_verify(home: Path, *args: str) -> Result:
    """`gym-coordinator ledger verify` on the served home's database."""
    argv = ["ledger", "verify", "-c", str(home / "coordinator.toml"), *args]
    return CliRunner().invoke(coordinator_app, argv, env={"COLUMNS": "200"})


def roll_back(home: Path, round_number: int, amount: str) -> None:
    """With sqlite3 only: delete the newest checkpoint, rewrite the reward of `round_number`."""
    db = sqlite3.connect(home / "ledger.db")
    db.execute("DELETE FROM checkpoints WHERE id = (SELECT MAX(id) FROM checkpoints)")
    (key,) = db.execute("SELECT id FROM rewards WHERE round_number = ?", (round_number,)).fetchone()
    for index, raw in db.execute("SELECT \"index\", record FROM log_entries WHERE kind = 'reward'"):
        record = json.loads(raw)
        rows = [r for r in record["rows"] if r["table"] == "rewards" and r["key"] == key]
        if rows:
            rows[0]["fields"]["amount"] = amount
            forged = canonical_json(record)
            db.execute(
                'UPDATE log_entries SET record = ?, leaf_hash = ? WHERE "index" = ?',
                (forged, merkle.leaf_hash(forged), index),
            )
    db.execute("UPDATE rewards SET amount = ? WHERE id = ?", (amount, key))
    db.commit()
    db.close()


def first_error(result: Result) -> str:
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    assert "Traceback" not in result.output, result.output
    return result.stderr.strip().splitlines()[0]


def test_a_rolled_back_ledger_is_caught_by_the_copy_and_by_a_contributor(
    tiny_home: Path, tmp_path: Path
) -> None:
    # Prepare: round 1 paid alice; serve keeps a copy of every checkpoint on "other storage"
    offsite = tmp_path / "offsite"
    offsite.mkdir()
    copy = offsite / "checkpoints.jsonl"
    alice_home, alice = contributor(tmp_path, tiny_home)
    pay_round(tiny_home, alice, 1, "4.5")
    token = admin_token(tiny_home)
    with serve(tiny_home, checkpoint_copy=str(copy)) as served:
        first = sign(served, token)
        seen_first = rewards_verify(served, alice_home)
        pay_round(tiny_home, alice, 2, "3.25")
        second = sign(served, token)
        seen_second = rewards_verify(served, alice_home)

        # Execute: the rollback, checked before and after the coordinator signs again
        roll_back(tiny_home, 2, "0.000000000")
        alone = ledger_verify(tiny_home)
        against_copy = ledger_verify(tiny_home, "--checkpoint", str(copy))
        from_rest = tmp_path / "second.json"  # the REST answer, kept by hand
        from_rest.write_text(json.dumps(second))
        against_rest_answer = ledger_verify(tiny_home, "--checkpoint", str(from_rest))
        shrank = rewards_verify(served, alice_home)
        third = sign(served, token)
        alone_resigned = ledger_verify(tiny_home)
        against_copy_resigned = ledger_verify(tiny_home, "--checkpoint", str(copy))
        forked = rewards_verify(served, alice_home)

    # Assert: before the attack every check passes and each checkpoint went to the copy
    assert seen_first.exit_code == 0 and seen_second.exit_code == 0, seen_second.output
    assert "the log extends the checkpoint of size" in seen_second.stdout
    copied = [json.loads(line) for line in copy.read_text().splitlines()]
    assert [c["root"] for c in copied] == [first["root"], second["root"], third["root"]]
    assert third["size"] == second["size"] and third["root"] != second["root"]

    # the database alone: the missing checkpoint is seen only until the coordinator signs again
    assert alone.exit_code == 1
    assert "round 2 ended (published) but no checkpoint covers it" in first_error(alone)
    assert alone_resigned.exit_code == 0, alone_resigned.output  # the finding
    # the copy outside the database catches it either way, naming the checkpoint
    for result in (against_copy, against_rest_answer, against_copy_resigned):
        line = first_error(result)
        assert result.exit_code == 1
        assert line.startswith(
            f"TAMPERED: kept: no entry (checkpoint): kept checkpoint of size {second['size']} "
        )
        assert f"an entry before {second['size']} was rewritten (the log forked)" in line
    # and so does alice, with the checkpoint she verified last
    assert shrank.exit_code == 1
    assert first_error(shrank).startswith("error: verification failed: the log shrank: ")
    assert forked.exit_code == 1
    assert first_error(forked).startswith(
        f"error: verification failed: the log forked: its checkpoint of size {second['size']} "
        "has another root than the checkpoint"
    )
