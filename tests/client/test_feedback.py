import logging
from pathlib import Path

import pytest
import torch

from zoo_gym.client.feedback import FfaErrorFeedback, least_squares_carry, summary
from zoo_gym.compression import CodecSpec, carry_spec, encode, inspect_envelope
from zoo_gym.core.lora import LoraSpec, frozen_a

SPEC = CodecSpec("bitdelta", group_size=8)
LORA = LoraSpec(rank=4, alpha=8.0)
MODULE = "model.layers.0.self_attn.q_proj"
KEY = f"{MODULE}.lora_B"
CARRY = f"{MODULE}.lora_B_carry"
DENSE = "model.layers.0.mlp.up_proj.weight"
IN_FEATURES = {MODULE: 16}


def _updates(seed: int, rounds: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    drift = torch.linspace(-0.05, 0.2, 48).view(12, 4)
    return [
        {
            KEY: drift + 0.1 * torch.randn(12, 4, generator=gen),
            DENSE: drift.T.repeat(2, 2) + 0.1 * torch.randn(8, 24, generator=gen),
        }
        for _ in range(rounds)
    ]


def _weight_space(b: torch.Tensor, seed: int, rank: int = LORA.rank) -> torch.Tensor:
    return LORA.scaling * b.double() @ frozen_a(seed, MODULE, 16, rank).double()


def _compress(feedback: FfaErrorFeedback, update: dict[str, torch.Tensor], seed: int, **kw: object):  # type: ignore[no-untyped-def]
    return feedback.compress(update, SPEC, lora=LORA, seed=seed, in_features=IN_FEATURES, **kw)  # type: ignore[arg-type]


def test_carry_of_hand_computed_matrices_is_the_least_squares_projection() -> None:
    # s·e·A_old = [2, 0, 0]; its projection onto the row [1, 1, 0] is [1, 1, 0] = 1·A_new,
    # and [1, -1, 0] (norm sqrt 2) lies outside A_new's row space
    e, a_old, a_new = (
        torch.tensor([[2.0]]),
        torch.tensor([[1.0, 0, 0]]),
        torch.tensor([[1.0, 1, 0]]),
    )

    carry, total, kept = least_squares_carry(e, a_old, a_new, scaling=1.0)

    assert carry.tolist() == [[1.0]]
    assert (total, kept) == (4.0, 2.0)  # dropped² = 4 - 2 = ||[1, -1, 0]||²


def test_carry_onto_the_same_row_space_loses_nothing() -> None:
    e = torch.tensor([[1.0, -2.0], [0.5, 3.0]])  # (out 2, r 2)
    a_old = torch.tensor([[1.0, 0, 1], [0, 1, 0]])  # (2, 3)
    a_new = torch.tensor([[1.0, 1, 1], [1.0, -1, 1]])  # the same row space, another basis

    carry, total, kept = least_squares_carry(e, a_old, a_new, scaling=2.0)

    torch.testing.assert_close(carry @ a_new.double(), e.double() @ a_old.double())
    assert kept == pytest.approx(total)


def test_within_an_epoch_what_was_sent_is_the_updates_minus_the_residual() -> None:
    feedback = FfaErrorFeedback()
    true_b, sent_b = (
        torch.zeros(12, 4, dtype=torch.float64),
        torch.zeros(12, 4, dtype=torch.float64),
    )
    true_d, sent_d = (
        torch.zeros(8, 24, dtype=torch.float64),
        torch.zeros(8, 24, dtype=torch.float64),
    )

    for update in _updates(0, 30):
        _, sent = _compress(feedback, update, seed=7)
        true_b += update[KEY].double()
        sent_b += sent[KEY].double()
        true_d += update[DENSE].double()
        sent_d += sent[DENSE].double()

    assert feedback.last_change is None and feedback.a_seed == 7
    assert feedback.residual[KEY].shape == (12, 4)  # B-space: the size of the update
    torch.testing.assert_close(true_b - sent_b, feedback.residual[KEY].double(), atol=1e-5, rtol=0)
    torch.testing.assert_close(
        true_d - sent_d, feedback.residual[DENSE].double(), atol=1e-5, rtol=0
    )
    assert float((true_b - sent_b).norm()) < 0.05 * float(true_b.norm())


def test_within_an_epoch_dyadic_updates_are_carried_exactly() -> None:
    # group of 8: scale = mean |x| is exact, so sent = ±scale and e = x - sent are exact in float32
    b1 = torch.tensor([[1.0, -0.5, 0.25, 2.0], [-1.0, 0.5, -0.25, 0.5]])  # (out 2, r 4)
    b2 = torch.tensor([[0.5, 0.5, -1.0, 0.0], [0.25, -2.0, 1.0, 0.5]])
    feedback = FfaErrorFeedback()
    lora, in_features = LoraSpec(rank=4, alpha=4.0), {MODULE: 16}

    sent = [
        feedback.compress({KEY: b}, SPEC, lora=lora, seed=3, in_features=in_features)[1][KEY]
        for b in (b1, b2)
    ]

    assert float(b1.abs().mean()) == 0.75  # the first round sends ±0.75
    assert sent[0].tolist() == [[0.75, -0.75, 0.75, 0.75], [-0.75, 0.75, -0.75, 0.75]]
    assert torch.equal(sent[0] + sent[1] + feedback.residual[KEY], b1 + b2)


def test_a_capped_update_keeps_what_the_cap_removed_in_the_residual() -> None:
    feedback = FfaErrorFeedback()
    true_b, sent_b = (
        torch.zeros(12, 4, dtype=torch.float64),
        torch.zeros(12, 4, dtype=torch.float64),
    )
    true_d, sent_d = (
        torch.zeros(8, 24, dtype=torch.float64),
        torch.zeros(8, 24, dtype=torch.float64),
    )

    for update in _updates(2, 10):
        _, sent = _compress(feedback, update, seed=1, max_norm=0.5)
        norm = sum(float(t.double().square().sum()) for t in sent.values()) ** 0.5
        assert norm <= 0.5 * (1 + 1e-3)  # BitDelta never grows the capped norm
        true_b += update[KEY].double()
        sent_b += sent[KEY].double()
        true_d += update[DENSE].double()
        sent_d += sent[DENSE].double()

    torch.testing.assert_close(true_b - sent_b, feedback.residual[KEY].double(), atol=1e-5, rtol=0)
    torch.testing.assert_close(
        true_d - sent_d, feedback.residual[DENSE].double(), atol=1e-5, rtol=0
    )


def test_a_change_of_a_carries_the_least_squares_projection_and_reports_the_rest() -> None:
    feedback = FfaErrorFeedback()
    first, second = _updates(3, 2)
    _compress(feedback, first, seed=0)
    e = feedback.residual[KEY].double()  # (out, r) for the A of seed 0

    _, sent = _compress(feedback, second, seed=1)

    # what was compensated (sent + the new residual) is the update plus the carried residual
    carried = sent[KEY].double() + feedback.residual[KEY].double() - second[KEY].double()
    target = _weight_space(e, 0)  # (out, in)
    a_new = frozen_a(1, MODULE, 16, LORA.rank).double()
    best = torch.linalg.lstsq(LORA.scaling * a_new.T, target.T).solution.T  # (out, r)
    torch.testing.assert_close(carried, best, atol=1e-5, rtol=0)
    change = feedback.last_change
    assert change is not None and (change.old_seed, change.new_seed) == (0, 1)
    assert change.dropped == pytest.approx(
        float((target - _weight_space(best, 1)).norm()), rel=1e-6
    )
    assert change.residual**2 == pytest.approx(change.carried**2 + change.dropped**2)
    assert change.update == pytest.approx(float(_weight_space(second[KEY], 1).norm()), rel=1e-6)
    assert feedback.a_seed == 1


def _names(payload: bytes) -> list[str]:
    return [ts.name for ts in inspect_envelope(payload, max_elements=1 << 20).layout]


def test_with_codec_none_nothing_is_lost_across_a_change_of_a() -> None:
    # a residual e for the A of seed 0 (as a restart loads it); round 1 of the epoch of seed 1
    e = torch.randn(12, 4, generator=torch.Generator().manual_seed(0))
    b = torch.randn(12, 4, generator=torch.Generator().manual_seed(1))
    feedback = FfaErrorFeedback({KEY: e.clone()}, a_seed=0)

    payload, sent = feedback.compress(
        {KEY: b}, CodecSpec("none"), lora=LORA, seed=1, carry_seed=0, in_features=IN_FEATURES
    )

    # s·(B·A_1 + B_carry·A_0) is everything: the update and the whole residual
    assert _names(payload) == [KEY, CARRY]
    assert torch.equal(sent[KEY], b) and torch.equal(sent[CARRY], e)
    merged = _weight_space(sent[KEY], 1) + _weight_space(sent[CARRY], 0)
    torch.testing.assert_close(merged, _weight_space(b, 1) + _weight_space(e, 0))
    assert sorted(feedback.residual) == [KEY] and not feedback.residual[KEY].any()
    change = feedback.last_change
    assert change is not None and (change.old_seed, change.new_seed) == (0, 1)
    assert change.residual == pytest.approx(float(_weight_space(e, 0).norm()), rel=1e-6)
    assert (change.remainder, change.carried, change.dropped) == (0.0, 0.0, 0.0)


def test_a_dyadic_residual_is_sent_back_exactly() -> None:
    # |e| is the same in every group of 8, so one bit and the scale 0.5 send it exactly
    e = torch.tensor([[0.5, -0.5, 0.5, 0.5], [-0.5, -0.5, 0.5, -0.5]])  # (out 2, r 4)
    b = torch.tensor([[1.0, -0.5, 0.25, 2.0], [-1.0, 0.5, -0.25, 0.5]])
    feedback = FfaErrorFeedback({KEY: e}, a_seed=4)
    lora, in_features = LoraSpec(rank=4, alpha=4.0), {MODULE: 16}

    _, sent = feedback.compress(
        {KEY: b}, SPEC, lora=lora, seed=5, carry_seed=4, in_features=in_features
    )

    assert torch.equal(sent[CARRY], e)
    assert torch.equal(feedback.residual[KEY], b - sent[KEY])  # the update's own error only
    assert feedback.last_change is not None and feedback.last_change.dropped == 0.0


def test_over_a_carry_only_the_carry_s_compression_error_is_dropped() -> None:
    # Prepare: 3 rounds on the A of seed 0, then 2 on seed 1, the first of them carrying back
    updates = _updates(7, 5)
    feedback = FfaErrorFeedback()
    true = torch.zeros(12, 16, dtype=torch.float64)
    merged = torch.zeros(12, 16, dtype=torch.float64)
    layouts = []

    # Execute
    for number, update in enumerate(updates, start=1):
        b = {KEY: update[KEY]}
        seed, carry = (0, None) if number <= 3 else (1, 0 if number == 4 else None)
        if number == 4:
            pending = feedback.residual[KEY].double()  # e for the A of seed 0
        payload, sent = _compress(feedback, b, seed=seed, carry_seed=carry)
        if number == 4:
            change, remainder = feedback.last_change, pending - sent[CARRY].double()
            merged += _weight_space(sent[CARRY], 0)
        layouts.append(_names(payload))
        true += _weight_space(update[KEY], seed)
        merged += _weight_space(sent[KEY], seed)

    # Assert: only round 4 carries; what the rounds merged is the true sum less the residual
    # kept for A_1 and D = s·r·A_0·(I - P_1) of the carry's remainder r = e - C(e)
    assert layouts == [[KEY]] * 3 + [[KEY, CARRY], [KEY]]
    lost = true - merged - _weight_space(feedback.residual[KEY], 1)
    a_new = frozen_a(1, MODULE, 16, LORA.rank).double()
    outside = _weight_space(remainder, 0)
    outside -= outside @ torch.linalg.pinv(a_new) @ a_new  # (I - P_1) on the right
    torch.testing.assert_close(lost, outside, atol=1e-5, rtol=0)
    assert change is not None and change.dropped == pytest.approx(float(lost.norm()), rel=1e-4)
    assert change.remainder == pytest.approx(float(_weight_space(remainder, 0).norm()), rel=1e-6)
    assert change.residual == pytest.approx(float(_weight_space(pending, 0).norm()), rel=1e-6)
    assert change.dropped < 0.6 * change.residual  # 0.46 of it; 0.83 carried by least squares
    assert sorted(feedback.residual) == [KEY] and feedback.nbytes() == 12 * 4 * 4


def test_a_residual_for_another_a_is_carried_by_least_squares_and_zeros_go_back() -> None:
    feedback = FfaErrorFeedback()
    _compress(feedback, {KEY: _updates(8, 1)[0][KEY]}, seed=6)  # the A before the last one
    e = feedback.residual[KEY].double()

    payload, sent = _compress(feedback, {KEY: torch.zeros(12, 4)}, seed=1, carry_seed=0)

    assert _names(payload) == [KEY, CARRY] and not sent[CARRY].any()
    a_new = frozen_a(1, MODULE, 16, LORA.rank).double()
    best = torch.linalg.lstsq(LORA.scaling * a_new.T, _weight_space(e, 6).T).solution.T
    carried = sent[KEY].double() + feedback.residual[KEY].double()
    torch.testing.assert_close(carried, best, atol=1e-5, rtol=0)
    change = feedback.last_change
    assert change is not None and change.old_seed == 6 and change.remainder == change.residual


def test_without_feedback_a_carry_round_sends_zeros_for_the_previous_a() -> None:
    off = FfaErrorFeedback(enabled=False)
    b = torch.randn(12, 4, generator=torch.Generator().manual_seed(3))

    payload, sent = off.compress({KEY: b}, SPEC, carry_seed=0)

    assert payload == encode({KEY: b, CARRY: torch.zeros(12, 4)}, SPEC)
    assert not sent[CARRY].any() and off.residual == {}


def test_a_higher_rank_of_the_same_seed_carries_everything() -> None:
    feedback, narrow = FfaErrorFeedback(), LoraSpec(rank=2, alpha=4.0)  # the same scaling
    first = {KEY: _updates(4, 1)[0][KEY][:, :2]}
    feedback.compress(first, SPEC, lora=narrow, seed=5, in_features=IN_FEATURES)
    target = _weight_space(feedback.residual[KEY], 5, rank=2)  # (out, in)

    _, sent = _compress(feedback, {KEY: torch.zeros(12, 4)}, seed=5)

    carried = sent[KEY].double() + feedback.residual[KEY].double()
    torch.testing.assert_close(_weight_space(carried, 5), target, atol=1e-5, rtol=0)
    assert feedback.last_change is not None  # A(rank 2) is the first rows of A(rank 4)
    assert feedback.last_change.dropped == pytest.approx(0.0, abs=1e-5)


def test_the_residual_is_no_larger_than_the_update_and_survives_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "feedback.safetensors"
    steady = FfaErrorFeedback()
    restarted = FfaErrorFeedback.load(path)
    for round_number, update in enumerate(_updates(2, 6), start=1):
        seed = (round_number - 1) // 3  # A changes after round 3; round 4 carries back
        carry = {"carry_seed": 0} if round_number == 4 else {}
        expected, _ = _compress(steady, update, seed=seed, round=round_number, **carry)
        got, _ = _compress(restarted, update, seed=seed, round=round_number, **carry)
        restarted.save(path)
        restarted = FfaErrorFeedback.load(path)  # a new process reads the client's state

        assert got == expected
        update_bytes = sum(t.numel() * 4 for t in update.values())
        saved = summary(path)
        assert saved is not None
        assert saved.residual_bytes <= update_bytes == saved.update_bytes
        assert restarted.nbytes() <= update_bytes
    assert sorted(restarted.residual) == [DENSE, KEY]
    assert (restarted.a_seed, restarted.a_since, restarted.round) == (1, 4, 6)
    assert path.stat().st_size < 2 * sum(t.numel() * 4 for t in _updates(2, 1)[0].values())


def test_a_change_of_a_after_a_restart_is_detected(tmp_path: Path) -> None:
    path = tmp_path / "feedback.safetensors"
    before = FfaErrorFeedback()
    _compress(before, _updates(5, 1)[0], seed=0)
    before.save(path)
    after = FfaErrorFeedback.load(path)

    _compress(after, _updates(6, 1)[0], seed=9)

    assert after.last_change is not None and after.last_change.old_seed == 0
    assert after.residual[KEY].shape == (12, 4)


def test_a_version_1_weight_space_residual_is_carried_onto_the_new_a(tmp_path: Path) -> None:
    weight = torch.randn(12, 16, generator=torch.Generator().manual_seed(0))  # (out, in)
    feedback = FfaErrorFeedback({KEY: weight})  # as version 1 saved it: no A seed

    _, sent = _compress(feedback, {KEY: torch.zeros(12, 4)}, seed=2)

    carried = sent[KEY].double() + feedback.residual[KEY].double()
    a_new = frozen_a(2, MODULE, 16, LORA.rank).double()
    best = torch.linalg.lstsq(LORA.scaling * a_new.T, weight.double().T).solution.T
    torch.testing.assert_close(carried, best, atol=1e-5, rtol=0)
    assert feedback.residual[KEY].shape == (12, 4)


def test_a_b_residual_of_an_unknown_a_is_dropped(caplog: pytest.LogCaptureFixture) -> None:
    feedback = FfaErrorFeedback({KEY: torch.ones(12, 4)})  # no A seed

    with caplog.at_level(logging.WARNING):
        payload, sent = _compress(feedback, {KEY: torch.randn(12, 4)}, seed=2)

    assert "unknown A" in caplog.text
    assert payload == encode({KEY: sent[KEY]}, SPEC)


def test_without_feedback_the_dense_sum_drifts_and_nothing_is_kept() -> None:
    off, on = FfaErrorFeedback(enabled=False), FfaErrorFeedback()
    true_d, sent_off, sent_on = torch.zeros(8, 24), torch.zeros(8, 24), torch.zeros(8, 24)

    for update in _updates(1, 30):
        dense = {DENSE: update[DENSE]}
        payload, sent = off.compress(dense, SPEC)
        assert payload == encode(dense, SPEC)
        sent_off += sent[DENSE]
        sent_on += on.compress(dense, SPEC)[1][DENSE]
        true_d += update[DENSE]

    assert off.residual == {}
    assert float((true_d - sent_off).norm()) > 5 * float((true_d - sent_on).norm())


def test_switching_error_feedback_off_removes_the_stale_file(tmp_path: Path) -> None:
    path = tmp_path / "feedback.safetensors"
    feedback = FfaErrorFeedback()
    feedback.compress({DENSE: torch.randn(8, 24)}, SPEC)
    feedback.save(path)

    FfaErrorFeedback.load(path, enabled=False).save(path)

    assert not path.exists()
    assert FfaErrorFeedback.load(path).residual == {}
    assert summary(path) is None


def test_ffa_keys_need_the_lora_spec() -> None:
    with pytest.raises(ValueError, match="lora"):
        FfaErrorFeedback().compress({KEY: torch.randn(12, 4)}, SPEC)


def test_residual_of_another_shape_is_dropped() -> None:
    feedback = FfaErrorFeedback({DENSE: torch.ones(3, 3)})

    payload, sent = feedback.compress({DENSE: torch.randn(8, 24)}, SPEC)

    assert payload == encode({DENSE: sent[DENSE]}, SPEC)
    assert feedback.residual[DENSE].shape == (8, 24)


def _carry_round(carry_codec: CodecSpec | None) -> tuple[bytes, FfaErrorFeedback]:
    """Round 4 of `_updates(7, 5)` (the first on the A of seed 1, carrying back the residual
    of 3 rounds on seed 0), its carried B compressed with `carry_codec`."""
    feedback = FfaErrorFeedback()
    for number, update in enumerate(_updates(7, 4), start=1):
        seed, carry = (0, None) if number <= 3 else (1, 0)
        payload, _ = _compress(
            feedback, {KEY: update[KEY]}, seed=seed, carry_seed=carry, carry_codec=carry_codec
        )
    return payload, feedback


def test_a_carry_codec_compresses_the_carried_bs_and_only_its_error_is_carried_on() -> None:
    # Prepare / Execute: the same residual sent back in BitDelta (as the update), int8, float32
    payloads, changes = {}, {}
    for name, codec in [
        ("bitdelta", None),
        ("int8", carry_spec(SPEC, "int8")),
        ("none", carry_spec(SPEC, "none")),
    ]:
        payloads[name], feedback = _carry_round(codec)
        changes[name] = feedback.last_change

    # Assert: the update stays BitDelta; the carried B is in its own codec (version 3)
    assert inspect_envelope(payloads["bitdelta"], max_elements=96).version == 2
    for name in ("int8", "none"):
        header = inspect_envelope(payloads[name], max_elements=96)
        assert header.version == 3 and [s.codec for s in header.sections] == ["bitdelta", name]
        assert header.sections[1].codec_spec == carry_spec(SPEC, name)
    bitdelta, int8, none = changes["bitdelta"], changes["int8"], changes["none"]
    assert bitdelta is not None and int8 is not None and none is not None
    assert bitdelta.residual == int8.residual == none.residual  # the same e went back
    assert none.remainder == none.dropped == 0.0  # float32 sends e exactly
    # int8's q is a rounding error: about 1/100 of BitDelta's, and so is what is dropped
    assert int8.remainder < bitdelta.remainder / 50
    assert int8.dropped < bitdelta.dropped / 50
    assert int8.remainder**2 == pytest.approx(int8.carried**2 + int8.dropped**2, rel=1e-6)


def test_without_feedback_the_zero_carried_bs_go_out_in_the_carry_codec() -> None:
    off = FfaErrorFeedback(enabled=False)
    b = torch.randn(12, 4, generator=torch.Generator().manual_seed(3))
    int8 = carry_spec(SPEC, "int8")

    payload, sent = off.compress({KEY: b}, SPEC, carry_seed=0, carry_codec=int8)

    assert payload == encode({KEY: b, CARRY: torch.zeros(12, 4)}, SPEC, own={CARRY: int8})
    assert not sent[CARRY].any() and off.residual == {}


def test_the_carry_codec_is_the_update_codec_when_the_task_names_none_or_the_same() -> None:
    assert carry_spec(SPEC, "") == carry_spec(SPEC, "bitdelta") == SPEC
    assert carry_spec(SPEC, "int8") == CodecSpec("int8", 8, "group", "float32")
    assert carry_spec(CodecSpec("int4", 64, "row"), "fp16") == CodecSpec(
        "fp16", 64, "row", "float32"
    )
