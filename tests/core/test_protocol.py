"""The round task, a signed submission and an intake result survive a Flower ConfigRecord;
statements sign every field."""

from __future__ import annotations

import dataclasses
import re

import pytest
from flwr.app import ConfigRecord

from zoo_gym.core.identity import Identity, verify
from zoo_gym.core.protocol import (
    PAYLOAD,
    IntakeResult,
    MalformedRecord,
    SignedSubmission,
    TaskConfig,
    Verdict,
)


def test_task_config_round_trips_through_a_config_record() -> None:
    task = TaskConfig(
        round=3, base_version="v0002", seed=2**62, lora_alpha=16, steps=5, codec="int8"
    )

    back = TaskConfig.from_record(ConfigRecord(task.to_record()))

    assert back == dataclasses.replace(task, lora_alpha=16.0)
    assert isinstance(back.lora_alpha, float) and isinstance(back.target_modules, tuple)


def test_submission_statement_covers_every_signed_field() -> None:
    sub = SignedSubmission("c1", 2, "v0001", "m1", b"\x01" * 16, "ab" * 32, 100)
    changed = [
        dataclasses.replace(sub, **{f.name: value})
        for f, value in zip(
            dataclasses.fields(sub)[:-1],
            ("c2", 3, "v0002", "m2", b"\x02" * 16, "cd" * 32, 101),
            strict=True,
        )
    ]
    assert len({s.statement() for s in [sub, *changed]}) == len(changed) + 1
    assert dataclasses.replace(sub, signature=b"x").statement() == sub.statement()


STATEMENT = (
    b'zoo-gym/v1|submission|{"base_version":"v0001","contributor_id":"c1","message_id":"m1",'
    b'"nonce":"01010101010101010101010101010101","payload_sha256":"' + b"ab" * 32 + b'",'
    b'"payload_size":100,"round":2}'
)


def test_signed_submission_round_trips_through_a_config_record_with_the_same_statement() -> None:
    # Prepare
    me = Identity.from_seed(b"\x07" * 32)
    sub = SignedSubmission("c1", 2, "v0001", "m1", b"\x01" * 16, "ab" * 32, 100).signed(me)

    # Execute
    back = SignedSubmission.from_record(ConfigRecord({**sub.to_record(), PAYLOAD: b"ZGDE"}))

    # Assert
    assert back == sub
    assert back.statement() == STATEMENT
    assert verify(me.public_key, back.signature, STATEMENT)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"round": None}, "the submission record has no 'round' field"),
        ({"round": "2"}, "the submission record's 'round' is str, not int"),
        ({"round": True}, "the submission record's 'round' is bool, not int"),
        ({"nonce": "01" * 16}, "the submission record's 'nonce' is str, not bytes"),
    ],
)
def test_a_malformed_submission_record_names_the_field(
    change: dict[str, object], message: str
) -> None:
    # Prepare
    sub = SignedSubmission("c1", 2, "v0001", "m1", b"\x01" * 16, "ab" * 32, 100)
    record: dict[str, object] = {**sub.to_record(), **change}
    record = {k: v for k, v in record.items() if v is not None}

    # Execute / Assert
    with pytest.raises(MalformedRecord, match=f"^{re.escape(message)}$"):
        SignedSubmission.from_record(record)


def test_intake_result_round_trips_through_a_config_record() -> None:
    sub = SignedSubmission("c1", 2, "v0001", "m1", b"\x01" * 16, "ab" * 32, 100)
    result = IntakeResult.of(sub, Verdict(True, "accepted at intake", 7))

    back = IntakeResult.from_record(ConfigRecord(result.to_record()))

    assert back == result == IntakeResult("c1", True, "accepted at intake", 7, "ab" * 32, 100)
    with pytest.raises(MalformedRecord, match="'accepted' is int, not bool"):
        IntakeResult.from_record({**result.to_record(), "accepted": 1})


def test_a_task_without_an_a_seed_freezes_a_from_the_round_seed() -> None:
    record = {"round": 3, "base_version": "v1", "seed": 42}  # an older coordinator's task

    task = TaskConfig.from_record(record)

    assert (task.a_seed, task.lora_a_rounds) == (42, 1)
    assert TaskConfig.from_record({**record, "a_seed": 7}).a_seed == 7
