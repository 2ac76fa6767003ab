"""`gym-coordinator apikey ...` and `gym-coordinator ledger verify` on a coordinator home."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from cli_server import gym, populate
from sqlmodel import Session

from zoo_gym import ledger
from zoo_gym.coordinator.config import load_config
from zoo_gym.coordinator.service import Coordinator


@pytest.fixture
def home(tiny_home: Path) -> Path:
    co = Coordinator(load_config(tiny_home / "coordinator.toml"))
    populate(co)  # one published round and the checkpoint signed at its end
    co.engine.dispose()
    return tiny_home


def test_apikey_create_list_revoke(home: Path) -> None:
    config = str(home / "coordinator.toml")

    created = gym(
        "apikey",
        "create",
        "--name",
        "prometheus",
        "--role",
        "viewer",
        "-c",
        config,
        "--format",
        "json",
    )
    listed = gym("apikey", "list", "-c", config, "--format", "json")
    key = json.loads(created.stdout)
    revoked = gym("apikey", "revoke", key["prefix"], "-c", config)
    bad_role = gym("apikey", "create", "--name", "x", "--role", "root", "-c", config)

    assert created.exit_code == 0 and key["token"].startswith(f"zgk_{key['prefix']}_")
    rows = json.loads(listed.stdout)
    assert [r["name"] for r in rows] == ["ops", "dash", "prometheus"]
    assert key["token"] not in listed.stdout and "secret_sha256" not in listed.stdout
    assert revoked.exit_code == 0 and "revoked viewer key" in revoked.stdout
    assert bad_role.exit_code == 1 and "error: --role must be admin or viewer" in bad_role.output
    engine = ledger.open_database(load_config(home / "coordinator.toml").ledger_url)
    with Session(engine) as s:
        assert ledger.authenticate_api_key(s, token=key["token"]) is None
    engine.dispose()


def test_apikey_create_table_prints_the_token_once(home: Path) -> None:
    result = gym(
        "apikey",
        "create",
        "--name",
        "alice",
        "--role",
        "admin",
        "-c",
        str(home / "coordinator.toml"),
    )
    assert result.exit_code == 0
    (token,) = [line for line in result.stdout.splitlines() if line.startswith("zgk_")]
    assert "shown only now" in result.stdout and len(token) > 40


def test_ledger_verify_ok(home: Path) -> None:
    result = gym("ledger", "verify", "-c", str(home / "coordinator.toml"))
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("OK: ") and "1 checkpoints" in result.stdout


def test_ledger_verify_detects_a_tampered_row(home: Path) -> None:
    # Prepare: raise a reward behind the ledger's back
    db = sqlite3.connect(home / "ledger.db")
    db.execute("UPDATE rewards SET amount = 1000 WHERE round_number = 1")
    db.commit()
    db.close()

    # Execute
    table = gym("ledger", "verify", "-c", str(home / "coordinator.toml"))
    as_json = gym("ledger", "verify", "-c", str(home / "coordinator.toml"), "--format", "json")

    # Assert
    assert table.exit_code == 1 and as_json.exit_code == 1
    assert table.output.startswith("TAMPERED: row: entry ") and "(reward)" in table.output
    assert "amount is '1000.000000000'" in table.output and "Traceback" not in table.output
    report = json.loads(as_json.stdout)
    assert not report["ok"] and "amount is '1000.000000000'" in report["problems"][0]


def test_ledger_verify_with_another_key_flags_checkpoints(home: Path) -> None:
    result = gym(
        "ledger", "verify", "-c", str(home / "coordinator.toml"), "--public-key", "00" * 32
    )
    assert result.exit_code == 1 and "signature does not verify" in result.output


def test_ledger_verify_without_a_ledger(tiny_home: Path) -> None:
    result = gym("ledger", "verify", "-c", str(tiny_home / "coordinator.toml"))
    assert result.exit_code == 1 and result.output.startswith("error: no ledger at ")


def test_ledger_checkpoint_json_is_a_line_verify_checks_the_log_against(
    home: Path, tmp_path: Path
) -> None:
    # Prepare: the newest checkpoint kept in a file, then a newer one signed and copied
    config = str(home / "coordinator.toml")
    kept = tmp_path / "kept.jsonl"
    shown = gym("ledger", "checkpoint", "-c", config, "--format", "json")
    kept.write_text(shown.stdout)
    toml = home / "coordinator.toml"
    toml.write_text(f'checkpoint_copy = "{kept}"\n' + toml.read_text())  # before any [table]
    signed = gym("ledger", "checkpoint", "-c", config, "--new")

    # Execute
    result = gym("ledger", "verify", "-c", config, "--checkpoint", str(kept))

    # Assert
    assert shown.exit_code == 0 and len(shown.stdout.splitlines()) == 1, shown.output
    assert signed.exit_code == 0 and signed.stdout.startswith("checkpoint of size "), signed.output
    assert len(kept.read_text().splitlines()) == 2  # --new appended to checkpoint_copy
    assert result.exit_code == 0, result.output
    assert "consistent with 2 checkpoint(s) kept outside the database" in result.stdout


def test_ledger_verify_fails_on_a_kept_checkpoint_whose_row_was_deleted(
    home: Path, tmp_path: Path
) -> None:
    config = str(home / "coordinator.toml")
    kept = tmp_path / "kept.json"
    kept.write_text(gym("ledger", "checkpoint", "-c", config, "--format", "json").stdout)
    db = sqlite3.connect(home / "ledger.db")
    db.execute("DELETE FROM checkpoints")
    db.commit()
    db.close()

    result = gym("ledger", "verify", "-c", config, "--checkpoint", str(kept))

    assert result.exit_code == 1 and "Traceback" not in result.output
    assert result.output.startswith(
        "TAMPERED: kept: no entry (checkpoint): kept checkpoint of size"
    )
    assert "is missing from the database: its row was deleted" in result.output


def test_ledger_verify_with_a_malformed_checkpoint_file(home: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    result = gym("ledger", "verify", "-c", str(home / "coordinator.toml"), "--checkpoint", str(bad))
    assert result.exit_code == 1 and len(result.output.strip().splitlines()) == 1
    assert result.output.startswith(f"error: {bad} line 1: ")
