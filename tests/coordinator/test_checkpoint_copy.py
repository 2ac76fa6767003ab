"""`checkpoint_copy`: every checkpoint the coordinator signs is appended to a file outside the
database, and the log verifies against that file."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from sqlmodel import Session, col, select

from zoo_gym import ledger
from zoo_gym.coordinator.config import CoordinatorConfig, load_config
from zoo_gym.coordinator.control import PolicyError, merge_policy
from zoo_gym.coordinator.service import Coordinator
from zoo_gym.core.synthetic import make_examples, shard
from zoo_gym.simulation.inprocess import InProcessFederation


def test_each_round_end_appends_its_checkpoint_to_the_copy(tiny_home: Path, tmp_path: Path) -> None:
    # Prepare
    copy = tmp_path / "offsite" / "checkpoints.jsonl"
    copy.parent.mkdir()
    overrides = {"rounds": 2, "min_clients": 2, "checkpoint_copy": str(copy)}
    fed = InProcessFederation.build(
        tiny_home, shard(make_examples(2 * 40, seed=3), 2), overrides=overrides
    )

    # Execute
    summaries = fed.run()

    # Assert: one line per round, each the stored checkpoint, and the log consistent with them
    kept = ledger.read_checkpoints(copy)
    co = fed.coordinator
    with Session(co.engine) as s:
        stored = [ledger.SignedCheckpoint.of(h, co.signer.public_key) for h in heads(s)]
        report = ledger.verify_ledger(s, public_key=co.signer.public_key, kept=kept)
    assert len(summaries) == 2 and kept == stored and len(kept) == 2
    assert report.ok and report.kept == 2, report.problems


def heads(session: Session) -> list[ledger.Checkpoint]:
    return list(session.exec(select(ledger.Checkpoint).order_by(col(ledger.Checkpoint.id))))


def test_a_copy_that_cannot_be_written_is_logged_and_the_checkpoint_kept(
    tiny_home: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = load_config(tiny_home / "coordinator.toml")
    missing = tmp_path / "not-mounted" / "checkpoints.jsonl"
    co = Coordinator(
        CoordinatorConfig.model_validate({**config.model_dump(), "checkpoint_copy": missing})
    )

    with caplog.at_level(logging.ERROR), Session(co.engine) as s:
        head = co.checkpoints.sign_checkpoint(s)
        latest = ledger.latest_checkpoint(s)
    co.engine.dispose()

    assert latest is not None and latest.id == head.id
    assert f"was not copied to {missing}" in caplog.text
    assert "fix checkpoint_copy's storage" in caplog.text


def test_an_api_key_cannot_redirect_the_copy(tiny_home: Path, tmp_path: Path) -> None:
    config = load_config(tiny_home / "coordinator.toml")
    with pytest.raises(PolicyError, match="checkpoint_copy is not a policy setting"):
        merge_policy(config, {"checkpoint_copy": str(tmp_path / "elsewhere.jsonl")})
