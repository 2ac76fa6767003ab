"""The strategy decodes and aggregates through the Triton kernels where they are active.

Without CUDA, ``ZOO_TRITON_ON_CPU=1`` (with TRITON_INTERPRET=1 from `tests/conftest.py`) makes
the coordinator's CPU take the kernel path it takes on a GPU; the round's result must not change.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from flwr.app import ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from stored_payloads import strategy_over

from zoo_gym.compression import CodecSpec, encode, kernels
from zoo_gym.compression.kernels import bitdelta_triton
from zoo_gym.coordinator.strategy import ZooStrategy, resolve_device
from zoo_gym.core.delta import layout_of
from zoo_gym.core.protocol import SUBMISSION, TRAIN_METRICS, IntakeResult
from zoo_gym.transport.flower_internals import set_task_identity


def _replies(directory: Path, k: int) -> tuple[list[Message], dict[str, torch.Tensor]]:
    set_task_identity(run_id=1, node_id=0, task_id=1)  # as `Coordinator.run` sets them
    gen = torch.Generator().manual_seed(k)
    shapes = {"a.lora_B": (24, 8), "b.lora_B": (7, 9)}
    replies = []
    for i in range(k):
        delta = {n: torch.randn(s, generator=gen) for n, s in shapes.items()}
        payload = encode(delta, CodecSpec("bitdelta", group_size=16))
        sha = hashlib.sha256(payload).hexdigest()
        (directory / sha).write_bytes(payload)
        intake = IntakeResult(f"c{i}", True, "", i + 1, sha, len(payload))
        content = RecordDict(
            {
                SUBMISSION: ConfigRecord(intake.to_record()),
                TRAIN_METRICS: MetricRecord({"num_examples": 10 + i}),
            }
        )
        replies.append(Message(content, dst_node_id=i + 1, message_type=MessageType.TRAIN))
    return replies, delta


def _strategy(directory: Path, rule: str, keep_rows: bool) -> ZooStrategy:
    strategy = strategy_over(directory, rule, keep_rows=keep_rows)
    strategy._record = lambda decisions: None  # type: ignore[method-assign]
    return strategy


@pytest.mark.parametrize(("rule", "keep_rows"), [("fedavg", False), ("trimmed_mean", True)])
def test_round_through_the_kernels_equals_the_cpu_round(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rule: str, keep_rows: bool
) -> None:
    # Prepare: five updates; fused FedAvg (decode_accumulate) or rows (decode_into) + a rule
    replies, example = _replies(tmp_path, 5)
    strategy = _strategy(tmp_path, rule, keep_rows)
    strategy.layout = lambda: layout_of(example)
    monkeypatch.delenv(kernels.ON_CPU, raising=False)
    expected = strategy.aggregate_round(1, replies)
    launches = []
    unpack = bitdelta_triton.unpack
    monkeypatch.setattr(bitdelta_triton, "unpack", lambda *a: (launches.append(a[-1]), unpack(*a)))

    # Execute
    monkeypatch.setenv(kernels.ON_CPU, "1")
    got = strategy.aggregate_round(1, replies)

    # Assert: the kernels decoded every tensor of every update, and nothing changed
    assert len(launches) == 5 * 2
    assert launches[0] is (not keep_rows)  # accumulated in place, or written into a row
    assert got.update.keys() == expected.update.keys()
    for name, value in got.update.items():
        assert value.device.type == "cpu"
        assert torch.equal(value, expected.update[name]), name
    assert got.row_contributors == expected.row_contributors


def test_device_names() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            resolve_device("cuda:0")
