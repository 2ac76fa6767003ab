"""Intake copies an accepted payload into place outside its lock and leaves no copy behind."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest
import torch
from flwr.app import RecordDict
from sqlmodel import Session

from zoo_gym import ledger
from zoo_gym.compression import CodecSpec, encode
from zoo_gym.coordinator.intake import OpenRound
from zoo_gym.core.delta import TensorSpec
from zoo_gym.core.protocol import SignedSubmission
from zoo_gym.simulation.inprocess import InProcessFederation

LAYOUT = (TensorSpec("m.lora_B", (4, 2)),)


@pytest.fixture
def federation(tiny_home: Path) -> InProcessFederation:
    """A coordinator with round 1 open for one `(4, 2)` tensor and one registered contributor."""
    fed = InProcessFederation.build(tiny_home, [[]], overrides={"min_clients": 1})
    with Session(fed.coordinator.engine) as session:
        ledger.open_round(
            session, number=1, base_version="v0000", seed=1, aggregator="fedavg", codec="none"
        )
    fed.coordinator.backend.open_round = OpenRound(1, "v0000", LAYOUT, 0)
    return fed


def submit(fed: InProcessFederation, spool: Path, values: torch.Tensor) -> tuple[bool, str]:
    payload = encode({"m.lora_B": values}, CodecSpec(codec="none"))
    spool.write_bytes(payload)
    (node, runtime), backend = next(iter(fed.runtimes.items())), fed.coordinator.backend
    fields = dict(
        contributor_id=runtime.identity.contributor_id,
        round=1,
        base_version="v0000",
        message_id=os.urandom(4).hex(),
        nonce=os.urandom(16),
        payload_sha256=hashlib.sha256(payload).hexdigest(),
        payload_size=len(payload),
    )
    unsigned = SignedSubmission(**fields)  # type: ignore[arg-type]
    signed = SignedSubmission(**fields, signature=runtime.identity.sign(unsigned.statement()))  # type: ignore[arg-type]
    verdict, _ = backend.receive(signed, spool, RecordDict(), node_id=node)
    return verdict.accepted, verdict.reason


def test_the_payload_is_copied_outside_the_lock_and_renamed_into_place(
    federation: InProcessFederation, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: watch every file copy intake makes, and whether its lock is held meanwhile
    intake = federation.coordinator.backend.intake
    copies: list[bool] = []
    real_copy = shutil.copyfile

    def watched(src: Path, dst: Path) -> object:
        copies.append(intake.lock.locked())
        return real_copy(src, dst)

    monkeypatch.setattr("zoo_gym.coordinator.intake.shutil.copyfile", watched)

    # Execute
    accepted = submit(federation, tmp_path / "upload.zgde", torch.ones(4, 2))

    # Assert: one copy, made without the lock; the payload under its SHA-256, no temporary left
    assert accepted == (True, "accepted at intake")
    assert copies == [False]
    payloads = sorted(p.name for p in intake.payload_dir.iterdir())
    digest = hashlib.sha256((tmp_path / "upload.zgde").read_bytes()).hexdigest()
    assert payloads == [f"{digest}.zgde"]


def test_a_refused_payload_leaves_nothing_in_the_payload_directory(
    federation: InProcessFederation, tmp_path: Path
) -> None:
    # Prepare / Execute: an accepted update, then a second one from the same contributor
    intake = federation.coordinator.backend.intake
    first = submit(federation, tmp_path / "a.zgde", torch.ones(4, 2))
    second = submit(federation, tmp_path / "b.zgde", torch.full((4, 2), 2.0))

    # Assert: the second passed every check of its own but was refused under the lock
    assert first[0] and not second[0], second
    assert [p.suffix for p in intake.payload_dir.iterdir()] == [".zgde"]
