"""The round task survives a Flower ConfigRecord; statements sign every field."""

from __future__ import annotations

import dataclasses

from flwr.app import ConfigRecord

from zoo_gym.core.protocol import SignedSubmission, TaskConfig


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
