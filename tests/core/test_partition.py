import doctest

import pytest

from zoo_gym.core import partition
from zoo_gym.core.partition import dirichlet_counts, label_counts, largest_remainder, split


def test_largest_remainder_by_hand() -> None:
    # 10 * (0.5, 0.25, 0.25) = 5, 2.5, 2.5: the tie goes to the first class
    assert largest_remainder([0.5, 0.25, 0.25], 10) == [5, 3, 2]
    assert largest_remainder([1, 1, 1], 7) == [3, 2, 2]
    assert largest_remainder([0.0, 1.0], 4) == [0, 4]
    assert doctest.testmod(partition).failed == 0
    with pytest.raises(ValueError, match="positive sum"):
        largest_remainder([0.0, 0.0], 3)


def test_label_split_gives_each_client_k_classes_in_equal_shards() -> None:
    prior = [0.25] * 4

    counts = label_counts(prior, 8, 60, classes_per_client=2, seed=0)

    # 8 clients x 2 shards = 16 shards, 4 of each class, 30 records each
    assert all(sum(row) == 60 for row in counts)
    assert all(n in (0, 30, 60) for row in counts for n in row)
    assert [sum(row[c] for row in counts) for c in range(4)] == [120] * 4
    assert all(1 <= sum(1 for n in row if n) <= 2 for row in counts)


def test_label_split_with_one_class_per_client_follows_the_prior() -> None:
    counts = label_counts([0.5, 0.25, 0.25], 4, 10, classes_per_client=1, seed=3)

    holders = sorted(next(c for c, n in enumerate(row) if n) for row in counts)
    assert holders == [0, 0, 1, 2]
    assert all(sorted(row) == [0, 0, 10] for row in counts)


def test_label_split_is_seeded() -> None:
    prior = [0.25] * 4

    first = label_counts(prior, 20, 12, classes_per_client=2, seed=5)

    assert first == label_counts(prior, 20, 12, classes_per_client=2, seed=5)
    assert first != label_counts(prior, 20, 12, classes_per_client=2, seed=6)


def test_label_split_refuses_more_classes_than_the_task_has() -> None:
    with pytest.raises(ValueError, match=r"classes per client must lie in 1\.\.4"):
        label_counts([0.25] * 4, 4, 10, classes_per_client=5, seed=0)
    with pytest.raises(ValueError, match="at least 3 records"):
        label_counts([0.25] * 4, 4, 2, classes_per_client=3, seed=0)


def test_dirichlet_rows_hold_size_records_and_are_seeded() -> None:
    counts = dirichlet_counts([0.25] * 4, 50, 60, alpha=0.5, seed=1)

    assert len(counts) == 50
    assert all(sum(row) == 60 and min(row) >= 0 for row in counts)
    assert counts == dirichlet_counts([0.25] * 4, 50, 60, alpha=0.5, seed=1)
    assert counts != dirichlet_counts([0.25] * 4, 50, 60, alpha=0.5, seed=2)


def test_dirichlet_large_alpha_is_near_iid_and_small_alpha_near_one_class() -> None:
    prior = [0.4, 0.3, 0.2, 0.1]

    near_iid = dirichlet_counts(prior, 100, 1000, alpha=1e5, seed=0)
    skewed = dirichlet_counts(prior, 100, 1000, alpha=0.01, seed=0)

    # Dir(1e5 * p) has sd sqrt(p (1 - p) / 1e5) < 0.002 per share: every row within 1% of p
    for row in near_iid:
        assert all(abs(n / 1000 - p) < 0.01 for n, p in zip(row, prior, strict=True))
    # with alpha = 0.01 nearly every client's largest class holds > 95% of its records
    assert sum(1 for row in skewed if max(row) > 950) >= 90
    # and the classes still turn up in about their prior shares across clients
    dominant = [max(range(4), key=row.__getitem__) for row in skewed]
    assert dominant.count(0) > dominant.count(3)


def test_dirichlet_tiny_alpha_does_not_break_down() -> None:
    counts = dirichlet_counts([0.5, 0.5], 10, 8, alpha=1e-320, seed=0)

    assert all(sorted(row) == [0, 8] for row in counts)


def test_split_deals_disjoint_shards_that_cover_the_pool() -> None:
    labels = [0, 1, 0, 1, 2, 2, 0, 1, 2, 0]  # class 0: 4 records, class 1: 3, class 2: 3
    counts = [[2, 1, 0], [0, 2, 1], [2, 0, 2]]

    shards = split(labels, counts, seed=0)

    assert sorted(i for s in shards for i in s) == list(range(10))
    for shard, row in zip(shards, counts, strict=True):
        assert [sum(1 for i in shard if labels[i] == c) for c in range(3)] == row
    assert shards == split(labels, counts, seed=0)


def test_split_draws_each_class_in_a_seeded_order() -> None:
    labels = [0] * 20

    draws = {tuple(split(labels, [[5], [15]], seed=s)[0]) for s in range(5)}

    assert len(draws) > 1


def test_split_refuses_a_pool_too_small() -> None:
    with pytest.raises(ValueError, match="holds 1 records of class 1"):
        split([0, 1, 0], [[1, 1], [1, 1]], seed=0)
