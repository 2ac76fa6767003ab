"""Epochs of a frozen A: the first round of each epoch after the first carries every client's
residual for the previous A as a second B, which the coordinator merges with that A."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from sqlmodel import Session

from zoo_gym import ledger
from zoo_gym.client.feedback import FfaErrorFeedback
from zoo_gym.client.runtime import ClientRuntime, compress_for_task
from zoo_gym.compression import CodecSpec, carry_spec, decode, encode, inspect_envelope
from zoo_gym.coordinator.intake import OpenRound, envelope_reason
from zoo_gym.coordinator.rounds import a_seed, carry_a_seed, lora_spec, update_layout
from zoo_gym.core.delta import Delta
from zoo_gym.core.lora import LoraSpec, carry_key, dense_delta, frozen_a, target_weights
from zoo_gym.core.protocol import TaskConfig
from zoo_gym.core.synthetic import make_examples, shard
from zoo_gym.core.tiny import build_tiny_model
from zoo_gym.simulation.inprocess import InProcessFederation


def test_only_the_first_round_of_a_later_epoch_carries_the_previous_a() -> None:
    carries = [carry_a_seed(0, n, 4) for n in range(1, 10)]

    assert carries == [None] * 4 + [a_seed(0, 4, 4)] + [None] * 3 + [a_seed(0, 8, 4)]
    assert carries[4] == a_seed(0, 1, 4) != a_seed(0, 5, 4)
    assert [carry_a_seed(3, n, 1) for n in range(1, 4)] == [None, a_seed(3, 1, 1), a_seed(3, 2, 1)]


def test_intake_wants_the_carried_bs_exactly_in_a_round_that_carries() -> None:
    # Prepare: the tiny base's layouts with and without the carried Bs
    state = build_tiny_model(vocab_size=100).state_dict()
    spec = LoraSpec(rank=4, target_modules=("q_proj",))
    plain, carrying = update_layout(state, spec), update_layout(state, spec, carry=True)
    b = {ts.name: torch.full(ts.shape, 0.01) for ts in plain}
    with_carry = {**b, **{carry_key(n.removesuffix(".lora_B")): t for n, t in b.items()}}
    codec = CodecSpec("bitdelta")

    def reason(delta: Delta, layout: tuple[object, ...]) -> str:
        current = OpenRound(1, "v0001", layout, deadline_ms=0, codec="bitdelta")  # type: ignore[arg-type]
        return envelope_reason(encode(delta, codec), current)

    # Assert
    assert [ts.name for ts in carrying] == [
        "model.layers.0.self_attn.q_proj.lora_B",
        "model.layers.0.self_attn.q_proj.lora_B_carry",
        "model.layers.1.self_attn.q_proj.lora_B",
        "model.layers.1.self_attn.q_proj.lora_B_carry",
    ]
    assert reason(b, plain) == reason(with_carry, carrying) == ""
    refused = "update tensors (names or shapes) differ from what this round trains"
    assert reason(with_carry, plain) == (  # a carry in a round that has none: too many values
        "update envelope is invalid: envelope declares 1024 values, more than max_elements=512"
    )
    assert reason(b, carrying).startswith(refused)  # no carry where the round wants one


def test_intake_wants_the_carried_bs_in_the_round_s_carry_codec() -> None:
    # Prepare: a carrying round's update and carried Bs; the round asks for int8 carries
    state = build_tiny_model(vocab_size=100).state_dict()
    layout = update_layout(state, LoraSpec(rank=4, target_modules=("q_proj",)), carry=True)
    delta = {ts.name: torch.full(ts.shape, 0.01) for ts in layout}
    carried = [ts.name for ts in layout if ts.name.endswith("_carry")]
    int8 = carry_spec(CodecSpec("bitdelta"), "int8")
    current = OpenRound(4, "v0003", layout, deadline_ms=0, codec="bitdelta", carry_codec="int8")
    older = OpenRound(4, "v0003", layout, deadline_ms=0, codec="bitdelta")  # carry_codec unset

    def reason(spec: CodecSpec, own: dict[str, CodecSpec], round: OpenRound = current) -> str:
        return envelope_reason(encode(delta, spec, own=own), round)

    # Assert
    assert reason(CodecSpec("bitdelta"), dict.fromkeys(carried, int8)) == ""
    assert reason(CodecSpec("bitdelta"), {}) == (
        "carried B model.layers.0.self_attn.q_proj.lora_B_carry is encoded with bitdelta but "
        "round 4 asks for int8; compress the carried Bs with the task's carry_codec"
    )
    assert reason(CodecSpec("bitdelta"), {carried[1]: int8}).startswith(
        "carried B model.layers.0.self_attn.q_proj.lora_B_carry is encoded with bitdelta"
    )
    assert reason(CodecSpec("int8"), {}) == (  # the update itself in the carry codec
        "update is encoded with int8 but round 4 asks for bitdelta; compress it with the "
        "task's codec"
    )
    assert reason(CodecSpec("bitdelta"), {}, older) == ""  # "" carries in the round's codec
    assert reason(CodecSpec("bitdelta"), dict.fromkeys(carried, int8), older).startswith(
        "carried B model.layers.0.self_attn.q_proj.lora_B_carry is encoded with int8 but round 4 "
        "asks for bitdelta"
    )


def test_a_task_record_without_a_carry_codec_carries_in_the_round_s_codec() -> None:
    # Prepare: an older coordinator's task record (no carry_codec) of a carrying round
    record = TaskConfig(round=5, base_version="v0004", seed=1, carry_a_seed=0).to_record()
    del record["carry_codec"]
    task = TaskConfig.from_record(record)
    spec = LoraSpec(rank=4, target_modules=("q_proj",))
    b = {"model.layers.0.self_attn.q_proj.lora_B": torch.randn(64, 4)}
    feedback = FfaErrorFeedback()

    # Execute
    payload = compress_for_task(
        feedback, b, task, spec, {"model.layers.0.self_attn.q_proj": 64}, honest=True
    )

    # Assert: one codec, a version 2 envelope, as before carry codecs existed
    header = inspect_envelope(payload, max_elements=512)
    assert task.carry_codec == "" and header.version == 2
    assert [s.codec for s in header.sections] == ["bitdelta", "bitdelta"]
    assert TaskConfig(round=1, base_version="v0", seed=1).carry_codec == ""


@dataclass
class Compressed:
    task: TaskConfig
    update: Delta  # the trained B of the round, before error feedback
    pending: Delta  # the residual the client held when it compressed
    payload: bytes


def _recorded(runtime: ClientRuntime, log: list[Compressed]) -> None:
    """Record what `runtime` compresses each round (the real `compress` does the work)."""
    real = runtime.compress

    def compress(update: Delta, task: TaskConfig, spec: LoraSpec, trainer: object) -> bytes:
        pending = {k: v.clone() for k, v in runtime.feedback.residual.items()}
        payload = real(update, task, spec, trainer)  # type: ignore[arg-type]
        log.append(Compressed(task, {k: v.clone() for k, v in update.items()}, pending, payload))
        return payload

    runtime.compress = compress  # type: ignore[method-assign]


def _lost_outside(remainder: torch.Tensor, old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """s·r·A_old·(I - P_new) `(out, in)`, with the projection formed densely (float64)."""
    weight = remainder.double() @ old.double()  # (out, in)
    return weight - weight @ torch.linalg.pinv(new.double()) @ new.double()


@pytest.mark.parametrize("carry_codec", ["int8", "bitdelta", "none"])
def test_merged_update_over_a_change_of_a_loses_only_the_carry_s_compression_error(
    tiny_home: Path, carry_codec: str
) -> None:
    # Prepare: two clients, epochs of 2 rounds; round 3 opens the second epoch and carries back
    overrides = {
        "rounds": 3,
        "min_clients": 2,
        "aggregator": "fedavg",
        "quality_gate_tolerance": 1e6,  # publish every round: the merged sum is what is checked
        "trusted_reputation": 0.0,  # every update weighs its 16 examples: 1/2 each, every round
        "training": {
            "steps": 2,
            "lora_a_rounds": 2,
            "lora_rank": 4,
            "carry_codec": carry_codec,
        },
    }
    fed = InProcessFederation.build(
        tiny_home, shard(make_examples(2 * 16, seed=5), 2), overrides=overrides
    )
    logs: dict[int, list[Compressed]] = {node: [] for node in fed.runtimes}
    for node, runtime in fed.runtimes.items():
        _recorded(runtime, logs[node])
    registry = fed.coordinator.registry
    initial = registry.load_state_dict(registry.latest().version)

    # Execute
    summaries = fed.run()

    # Assert: every round published, each client weighed 1/2
    assert [s.status for s in summaries] == ["published"] * 3
    with Session(fed.coordinator.engine) as session:
        assert {s.weight for s in ledger.list_submissions(session)} == {0.5}
    spec = lora_spec(fed.coordinator.config.training)
    shapes = target_weights(initial, spec)
    final = registry.load_state_dict(registry.latest().version)
    merged = {k: final[k].double() - initial[k].double() for k in final}
    expected = {m + ".weight": torch.zeros(shapes[m], dtype=torch.float64) for m in shapes}
    shares: dict[int, float] = {}
    for node, log in logs.items():
        tasks = [c.task for c in log]
        assert [t.carry_seed for t in tasks] == [None, None, tasks[0].a_seed]
        assert tasks[0].a_seed == tasks[1].a_seed != tasks[2].a_seed
        assert {t.carry_codec for t in tasks} == {carry_codec}
        sections = inspect_envelope(log[2].payload, max_elements=1 << 24).sections
        assert {s.codec for s in sections if s.spec.name.endswith("_carry")} == {carry_codec}
        assert {s.codec for s in sections if s.spec.name.endswith(".lora_B")} == {"bitdelta"}
        names = [
            [ts.name for ts in inspect_envelope(c.payload, max_elements=1 << 24).layout]
            for c in log
        ]
        assert not any(n.endswith("_carry") for n in names[0] + names[1])
        assert sorted(names[2]) == sorted(
            [m + ".lora_B" for m in shapes] + [m + ".lora_B_carry" for m in shapes]
        )
        # the client's true updates, less what it still holds for the new A ...
        for c in log:
            for name, delta in dense_delta(
                c.update, spec=spec, seed=c.task.a_seed, shapes=shapes
            ).items():
                expected[name] += 0.5 * delta.double()
        kept = dense_delta(
            fed.runtimes[node].feedback.residual, spec=spec, seed=tasks[2].a_seed, shapes=shapes
        )
        # ... and less only D = s·(e - C(e))·A_old·(I - P_new) of the carried Bs
        carry = log[2]
        sent = decode(carry.payload, max_elements=1 << 24)
        dropped_sq = 0.0
        for module, (_out, width) in shapes.items():
            remainder = carry.pending[module + ".lora_B"] - sent[carry_key(module)]
            old = frozen_a(tasks[0].a_seed, module, width, spec.rank)
            new = frozen_a(tasks[2].a_seed, module, width, spec.rank)
            lost = spec.scaling * _lost_outside(remainder, old, new)
            expected[module + ".weight"] -= 0.5 * (kept[module + ".weight"].double() + lost)
            dropped_sq += float(lost.square().sum())
        change = fed.runtimes[node].feedback.last_change
        assert change is not None and change.dropped == pytest.approx(
            dropped_sq**0.5, abs=1e-9, rel=1e-4
        )
        # without the carry: nearly all of the residual; BitDelta's q is 0.6 of e, int8's
        # a rounding error, float32's nothing
        bound = {"bitdelta": 0.7, "int8": 0.01}.get(carry_codec, 0.0)
        assert change.dropped <= bound * change.residual
        shares[node] = change.dropped_share
    for name, value in expected.items():
        torch.testing.assert_close(merged[name], value, atol=2e-6, rtol=0)
    assert all(torch.equal(final[k], initial[k]) for k in final if k not in expected)
    if carry_codec == "int8":  # of the round's update, the client's ChangeOfA record
        assert max(shares.values()) < 0.02
