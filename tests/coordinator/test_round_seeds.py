from __future__ import annotations

from zoo_gym.coordinator.rounds import a_seed, round_seed


def test_a_stays_for_an_epoch_of_rounds_and_data_seeds_still_change() -> None:
    seeds = [a_seed(0, n, 4) for n in range(1, 10)]

    assert seeds == [round_seed(0, 1)] * 4 + [round_seed(0, 5)] * 4 + [round_seed(0, 9)]
    assert len({round_seed(0, n) for n in range(1, 10)}) == 9


def test_one_round_epochs_use_the_round_seed() -> None:
    assert [a_seed(3, n, 1) for n in range(1, 5)] == [round_seed(3, n) for n in range(1, 5)]
