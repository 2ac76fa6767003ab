"""The strategy's own check for NaN / Inf before a rule reads an update (intake refuses them
first; this is the second line): it must look at every tensor whose codec sends values as
they are, also inside an envelope whose main codec is BitDelta (a carried B in fp16)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from flwr.app import ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from stored_payloads import strategy_over

from zoo_gym.compression import CodecSpec, encode, inspect_envelope
from zoo_gym.core.delta import layout_of
from zoo_gym.core.protocol import SUBMISSION, TRAIN_METRICS, IntakeResult
from zoo_gym.ledger import AggregationDecision
from zoo_gym.transport.flower_internals import set_task_identity

SHAPES = {"a.lora_B": (16, 4), "a.lora_B_carry": (16, 4)}
FP16_NAN = b"\x00\x7e"


def _payload(i: int, poisoned: bool) -> bytes:
    gen = torch.Generator().manual_seed(i)
    delta = {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}
    spec = CodecSpec("bitdelta", group_size=16)
    data = bytearray(encode(delta, spec, own={"a.lora_B_carry": CodecSpec("fp16")}))
    if poisoned:  # a NaN in the carried B's values, the digest made right again
        header = inspect_envelope(bytes(data), max_elements=128)
        (carry,) = [s for s in header.sections if s.spec.name == "a.lora_B_carry"]
        data[carry.data_offset + 6 : carry.data_offset + 8] = FP16_NAN
        data[-32:] = hashlib.sha256(data[:-32]).digest()
    return bytes(data)


@pytest.mark.parametrize("memory", [2 << 30, 1 << 10], ids=["in memory", "payload columns"])
def test_a_nan_in_a_carried_fp16_tensor_is_refused_before_the_rule(
    tmp_path: Path, memory: int
) -> None:
    # Prepare: four updates, the third with a NaN in its fp16 carried B
    set_task_identity(run_id=1, node_id=0, task_id=1)
    replies = []
    for i in range(4):
        payload = _payload(i, poisoned=i == 2)
        sha = hashlib.sha256(payload).hexdigest()
        (tmp_path / sha).write_bytes(payload)
        intake = IntakeResult(f"c{i}", True, "", i + 1, sha, len(payload))
        content = RecordDict(
            {
                SUBMISSION: ConfigRecord(intake.to_record()),
                TRAIN_METRICS: MetricRecord({"num_examples": 10}),
            }
        )
        replies.append(Message(content, dst_node_id=i + 1, message_type=MessageType.TRAIN))
    layout = layout_of({n: torch.zeros(s) for n, s in SHAPES.items()})
    strategy = strategy_over(tmp_path, "median", layout=lambda: layout, memory=memory)
    recorded: list[AggregationDecision] = []
    strategy._record = recorded.extend  # type: ignore[method-assign,assignment]

    # Execute
    result = strategy.aggregate_round(1, replies)

    # Assert: the third is left out for its NaN, the rule saw the other three
    refused = [d for d in recorded if not d.selected]
    assert [d.submission_id for d in refused] == [3]
    assert refused[0].reason in (
        "update contains NaN or Inf values",  # the payload columns' check
        "could not be decoded: non-finite value in a fp16 tensor",  # decoding a row
    )
    assert result.row_contributors == ("c0", "c1", "c3")
    assert all(torch.isfinite(v).all() for v in result.update.values())
