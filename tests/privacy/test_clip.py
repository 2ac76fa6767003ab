import pytest
import torch

from zoo_gym.privacy.clip import clip_delta


def test_clips_to_the_global_norm() -> None:
    delta = {"a": torch.tensor([3.0, 0.0]), "b": torch.tensor([[4.0]])}  # norm 5

    clipped, norm = clip_delta(delta, 1.0)

    assert norm == 5.0
    torch.testing.assert_close(clipped["a"], torch.tensor([0.6, 0.0]))
    torch.testing.assert_close(clipped["b"], torch.tensor([[0.8]]))
    assert delta["a"].tolist() == [3.0, 0.0]  # input untouched


def test_small_updates_pass_unchanged() -> None:
    delta = {"a": torch.tensor([1.0, 2.0, 2.0])}  # norm 3

    clipped, norm = clip_delta(delta, 10.0)

    assert norm == 3.0
    assert torch.equal(clipped["a"], delta["a"]) and clipped["a"] is not delta["a"]


def test_norm_is_accumulated_in_float64() -> None:
    delta = {"a": torch.full((4,), 1e20, dtype=torch.float32)}  # float32 squares overflow

    clipped, norm = clip_delta(delta, 1.0)

    assert norm == pytest.approx(2e20)
    torch.testing.assert_close(clipped["a"], torch.full((4,), 0.5))


def test_zero_update_and_bad_arguments() -> None:
    assert clip_delta({"a": torch.zeros(3)}, 1.0)[1] == 0.0
    with pytest.raises(ValueError, match="positive"):
        clip_delta({"a": torch.ones(1)}, 0.0)
    with pytest.raises(ValueError, match="non-finite"):
        clip_delta({"a": torch.tensor([float("nan")])}, 1.0)
