"""The omniscient adversary: crafted replies are the attack on the decoded honest updates, signed."""

from __future__ import annotations

import pytest
import torch
from flwr.app import ConfigRecord, Message, RecordDict

from zoo_gym.client.runtime import signed_reply
from zoo_gym.compression import CodecSpec, decode, encode
from zoo_gym.core.identity import Identity, verify
from zoo_gym.core.protocol import PAYLOAD, SUBMISSION, TASK_CONFIG, TaskConfig
from zoo_gym.simulation.adversary import Adversary
from zoo_gym.transport.flower_internals import assign_message_id, set_task_identity
from zoo_gym.transport.records import unpack_reply

TASK = TaskConfig(
    round=3,
    base_version="v0002",
    seed=7,
    lora_rank=2,
    lora_alpha=4.0,
    target_modules=("q_proj",),
    steps=1,
    learning_rate=0.01,
    batch_size=1,
    max_length=16,
    clip_norm=0.0,
    codec="none",
    group_size=128,
    deadline_ms=0,
)


@pytest.fixture(autouse=True)
def _server_identity() -> None:
    """Messages are created as the ServerApp creates them (run 1, node 0)."""
    set_task_identity(run_id=1, node_id=0, task_id=1)


def _request(node: int) -> Message:
    message = Message(RecordDict({TASK_CONFIG: ConfigRecord(TASK.to_record())}), node, "train")
    assign_message_id(message, f"m{node}")
    return message


def _honest(values: list[list[float]]) -> list[Message]:
    replies = []
    for i, row in enumerate(values):
        payload = encode({"b": torch.tensor(row).reshape(2, 2)}, CodecSpec(codec="none"))
        replies.append(
            signed_reply(
                Identity.generate(),
                _request(100 + i),
                TASK,
                payload,
                {"num_examples": 10.0 * (i + 1)},
            )
        )
    return replies


def test_sign_flip_reply_is_minus_the_honest_mean_and_signed_by_the_attacker() -> None:
    # Prepare: two honest updates whose mean is [2, 2, 2, 2]
    honest = _honest([[1.0, 1.0, 1.0, 1.0], [3.0, 3.0, 3.0, 3.0]])
    attacker = Identity.generate()
    adversary = Adversary("sign_flip", {9: attacker}, f=1, params={"scale": 2.0})

    # Execute
    (reply,) = adversary.replies(honest, [_request(9)])

    # Assert: -2 * mean, encoded with the round's codec, signed with the attacker's key
    sub, payload, _ = unpack_reply(reply)
    assert torch.equal(decode(payload, max_elements=4)["b"], torch.full((2, 2), -4.0))
    assert sub.contributor_id == attacker.contributor_id
    assert (sub.round, sub.base_version, sub.message_id) == (3, "v0002", "m9")
    assert verify(attacker.public_key, sub.signature, sub.statement())
    assert reply.content.metric_records["metrics"]["num_examples"] == 15.0  # claims the honest mean


def test_alie_uses_mean_and_std_of_honest_updates() -> None:
    # Prepare
    honest = _honest([[0.0, 2.0, 0.0, 2.0], [2.0, 0.0, 2.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    adversary = Adversary(
        "alie", {1: Identity.generate(), 2: Identity.generate()}, f=2, params={"z": 1.0}
    )

    # Execute
    replies = adversary.replies(honest, [_request(1), _request(2)])

    # Assert: mean 1, std 1 per coordinate -> 1 - 1 * 1 = 0 for both attackers
    for reply in replies:
        payload = bytes(reply.content.config_records[SUBMISSION][PAYLOAD])  # type: ignore[arg-type]
        assert torch.allclose(decode(payload, max_elements=4)["b"], torch.zeros(2, 2), atol=1e-6)


def test_no_requests_no_replies_and_unknown_attack_is_refused() -> None:
    assert Adversary("gaussian", {}, f=0).replies([], []) == []
    with pytest.raises(ValueError, match="unknown update attack 'nope'"):
        Adversary("nope", {}, f=0)
