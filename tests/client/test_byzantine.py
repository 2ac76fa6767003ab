"""A deliberately misbehaving contributor: poisoned data or a corrupted update."""

from __future__ import annotations

import pytest
import torch

from zoo_gym.client.byzantine import Misbehaviour
from zoo_gym.client.config import ClientConfig

CONVERSATIONS = [
    [{"role": "user", "content": f"{i}+{i}"}, {"role": "assistant", "content": str(2 * i)}]
    for i in range(6)
]


def test_label_flip_changes_every_answer_and_keeps_the_questions() -> None:
    # Execute
    poisoned = Misbehaviour("label_flip", seed=3).poison(CONVERSATIONS)

    # Assert
    assert [c[0] for c in poisoned] == [c[0] for c in CONVERSATIONS]
    answers = [c[1]["content"] for c in poisoned]
    assert all(a != str(2 * i) for i, a in enumerate(answers))
    assert set(answers) <= {str(2 * i) for i in range(6)}
    assert CONVERSATIONS[0][1]["content"] == "0"  # input untouched


def test_update_attacks_apply_to_the_own_update() -> None:
    update = {"a": torch.tensor([1.0, -2.0]), "b": torch.tensor([[0.5]])}

    flipped = Misbehaviour("sign_flip").corrupt(update, round_number=1)
    scaled = Misbehaviour("scaling").corrupt(update, round_number=1)
    boosted = Misbehaviour("scaling", {"boost": 3.0}).corrupt(update, round_number=1)

    assert torch.equal(flipped["a"], torch.tensor([-1.0, 2.0])) and torch.equal(
        flipped["b"], torch.tensor([[-0.5]])
    )
    assert torch.equal(scaled["a"], torch.tensor([-10.0, 20.0]))  # default boost 10
    assert torch.equal(boosted["b"], torch.tensor([[-1.5]]))


def test_data_attack_leaves_the_update_and_update_attack_leaves_the_data() -> None:
    update = {"a": torch.tensor([1.0])}
    assert Misbehaviour("label_flip").corrupt(update, round_number=1) is update
    assert Misbehaviour("sign_flip").poison(CONVERSATIONS) is CONVERSATIONS


def test_unknown_attack_is_one_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown attack 'alie'; choose one of label_flip"):
        Misbehaviour("alie")
    with pytest.raises(ValueError, match="byzantine must be one of"):
        ClientConfig.model_validate({"byzantine": "krum"})
