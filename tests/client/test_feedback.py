from pathlib import Path

import pytest
import torch

from zoo_gym.client.feedback import FfaErrorFeedback
from zoo_gym.compression import CodecSpec, encode
from zoo_gym.core.lora import LoraSpec, frozen_a

SPEC = CodecSpec("bitdelta", group_size=8)
LORA = LoraSpec(rank=4, alpha=8.0)
MODULE = "model.layers.0.self_attn.q_proj"
DENSE = "model.layers.0.mlp.up_proj.weight"
IN_FEATURES = {MODULE: 16}


def _updates(seed: int, rounds: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    drift = torch.linspace(-0.05, 0.2, 48).view(12, 4)
    return [
        {
            f"{MODULE}.lora_B": drift + 0.1 * torch.randn(12, 4, generator=gen),
            DENSE: drift.T.repeat(2, 2) + 0.1 * torch.randn(8, 24, generator=gen),
        }
        for _ in range(rounds)
    ]


def _weight_space(b: torch.Tensor, seed: int) -> torch.Tensor:
    return LORA.scaling * b.double() @ frozen_a(seed, MODULE, 16, LORA.rank).double()


def test_residuals_equal_what_was_not_sent_for_both_kinds_of_key() -> None:
    feedback = FfaErrorFeedback()
    true_w = torch.zeros(12, 16, dtype=torch.float64)
    sent_w = torch.zeros(12, 16, dtype=torch.float64)
    true_d = torch.zeros(8, 24, dtype=torch.float64)
    sent_d = torch.zeros(8, 24, dtype=torch.float64)

    for seed, update in enumerate(_updates(0, 30)):
        _, sent = feedback.compress(update, SPEC, lora=LORA, seed=seed, in_features=IN_FEATURES)
        true_w += _weight_space(update[f"{MODULE}.lora_B"], seed)
        sent_w += _weight_space(sent[f"{MODULE}.lora_B"], seed)
        true_d += update[DENSE].double()
        sent_d += sent[DENSE].double()

    torch.testing.assert_close(
        true_w - sent_w, feedback.residual[f"{MODULE}.lora_B"].double(), atol=1e-5, rtol=0
    )
    torch.testing.assert_close(
        true_d - sent_d, feedback.residual[DENSE].double(), atol=1e-5, rtol=0
    )
    assert float((true_d - sent_d).norm()) < 0.05 * float(true_d.norm())


def test_a_capped_update_keeps_what_the_cap_removed_in_the_residual() -> None:
    feedback = FfaErrorFeedback()
    true_w = torch.zeros(12, 16, dtype=torch.float64)
    sent_w = torch.zeros(12, 16, dtype=torch.float64)
    true_d = torch.zeros(8, 24, dtype=torch.float64)
    sent_d = torch.zeros(8, 24, dtype=torch.float64)

    for seed, update in enumerate(_updates(2, 10)):
        _, sent = feedback.compress(
            update, SPEC, lora=LORA, seed=seed, in_features=IN_FEATURES, max_norm=0.5
        )
        norm = sum(float(t.double().square().sum()) for t in sent.values()) ** 0.5
        assert norm <= 0.5 * (1 + 1e-3)  # BitDelta never grows the capped norm
        true_w += _weight_space(update[f"{MODULE}.lora_B"], seed)
        sent_w += _weight_space(sent[f"{MODULE}.lora_B"], seed)
        true_d += update[DENSE].double()
        sent_d += sent[DENSE].double()

    torch.testing.assert_close(
        true_w - sent_w, feedback.residual[f"{MODULE}.lora_B"].double(), atol=1e-5, rtol=0
    )
    torch.testing.assert_close(
        true_d - sent_d, feedback.residual[DENSE].double(), atol=1e-5, rtol=0
    )


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


def test_residuals_survive_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "feedback.safetensors"
    updates = _updates(2, 4)
    steady = FfaErrorFeedback()
    restarted = FfaErrorFeedback.load(path)
    for seed, update in enumerate(updates):
        expected, _ = steady.compress(update, SPEC, lora=LORA, seed=seed, in_features=IN_FEATURES)
        got, _ = restarted.compress(update, SPEC, lora=LORA, seed=seed, in_features=IN_FEATURES)
        restarted.save(path)
        restarted = FfaErrorFeedback.load(path)  # a new process reads the client's state

        assert got == expected
    assert sorted(restarted.residual) == [DENSE, f"{MODULE}.lora_B"]


def test_switching_error_feedback_off_removes_the_stale_file(tmp_path: Path) -> None:
    path = tmp_path / "feedback.safetensors"
    feedback = FfaErrorFeedback()
    feedback.compress({DENSE: torch.randn(8, 24)}, SPEC)
    feedback.save(path)

    FfaErrorFeedback.load(path, enabled=False).save(path)

    assert not path.exists()
    assert FfaErrorFeedback.load(path).residual == {}


def test_ffa_keys_need_the_lora_spec() -> None:
    with pytest.raises(ValueError, match="lora"):
        FfaErrorFeedback().compress({f"{MODULE}.lora_B": torch.randn(12, 4)}, SPEC)


def test_residual_of_another_shape_is_dropped() -> None:
    feedback = FfaErrorFeedback({DENSE: torch.ones(3, 3)})

    payload, sent = feedback.compress({DENSE: torch.randn(8, 24)}, SPEC)

    assert payload == encode({DENSE: sent[DENSE]}, SPEC)
    assert feedback.residual[DENSE].shape == (8, 24)
