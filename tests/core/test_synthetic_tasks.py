import random
from collections import Counter

import pytest

from zoo_gym.core.synthetic import (
    OPERATIONS,
    TASKS,
    make_examples,
    operation_example,
    operation_of,
    sum_bucket,
)
from zoo_gym.core.tiny import task_tokenizer


def _operands(question: str) -> tuple[int, int]:
    words = question.replace("?", " ").replace(".", " ").split()
    a, b = (int(w) for w in words if w.isdigit())
    return a, b


def test_each_operation_answers_correctly() -> None:
    rng = random.Random(0)
    expected = {
        "add": lambda a, b: str(a + b),
        "subtract": lambda a, b: str(a - b),
        "multiply": lambda a, b: str(a * b),
        "compare": lambda a, b: "yes" if a < b else "no",
    }

    for index, name in enumerate(OPERATIONS):
        for _ in range(50):
            record = operation_example(index, rng)
            a, b = _operands(record["instruction"])
            assert record["output"] == expected[name](a, b)
            assert operation_of(record) == index


def test_operation_of_refuses_other_records() -> None:
    with pytest.raises(ValueError, match="not an arithmetic record"):
        operation_of({"instruction": "Add 3 and 4.", "input": "", "output": "7"})


def test_addition_buckets_are_the_answers_tens_digit() -> None:
    task = TASKS["addition"]
    rng = random.Random(1)

    assert len(task.classes) == 10  # sums 0..98
    assert task.prior[0] == pytest.approx(55 / 2500)  # a + b <= 9: 10 + 9 + ... + 1 pairs
    assert task.prior[9] == pytest.approx(45 / 2500)  # a + b >= 90: 9 + 8 + ... + 1 pairs
    assert sum(task.prior) == pytest.approx(1.0)
    for bucket in range(10):
        record = task.example(bucket, rng)
        assert sum_bucket(record) == bucket
        assert int(record["output"]) == sum(_operands(record["instruction"]))


def test_iid_addition_records_are_the_original_task() -> None:
    assert TASKS["addition"].examples(30, seed=4) == make_examples(30, seed=4)


def test_iid_arithmetic_records_mix_the_operations() -> None:
    task = TASKS["arithmetic"]

    records = task.examples(400, seed=0)

    shares = Counter(operation_of(r) for r in records)
    assert sorted(shares) == [0, 1, 2, 3]
    assert all(70 <= n <= 130 for n in shares.values())  # 100 each expected
    assert records == task.examples(400, seed=0)


def test_balanced_split_weighs_every_class_alike() -> None:
    task = TASKS["arithmetic"]

    records = task.balanced(202, seed=0)

    assert sorted(Counter(operation_of(r) for r in records).values()) == [50, 50, 51, 51]
    assert records == task.balanced(202, seed=0)


def test_the_tiny_tokenizer_encodes_every_operation_without_unknowns() -> None:
    tokenizer = task_tokenizer(seed=0)
    rng = random.Random(2)

    for index in range(len(OPERATIONS)):
        record = operation_example(index, rng)
        for text in (record["instruction"], record["output"]):
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            assert tokenizer.decode(ids) == text
            assert tokenizer.unk_token_id is None or tokenizer.unk_token_id not in ids
