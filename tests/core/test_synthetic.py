import doctest
import json
from pathlib import Path

from zoo_gym.core import synthetic
from zoo_gym.core.chat import to_conversation


def test_examples_are_reproducible_and_correct() -> None:
    records = synthetic.make_examples(50, seed=3)

    assert records == synthetic.make_examples(50, seed=3)
    assert records != synthetic.make_examples(50, seed=4)
    for record in records:
        a, b = (
            int(x)
            for x in record["instruction"].replace("?", " ").replace(".", " ").split()
            if x.isdigit()
        )
        assert synthetic.answer_of(record) == str(a + b)
        assert record["input"] == ""


def test_exact_match_reward_doctest() -> None:
    result = doctest.testmod(synthetic)

    assert result.attempted >= 3
    assert result.failed == 0
    assert synthetic.exact_match_reward("19<|im_end|>", "19") == 0.0
    assert synthetic.exact_match_reward("19\nbecause", "19") == 1.0


def test_shard_is_a_disjoint_cover() -> None:
    records = synthetic.make_examples(10, seed=0)

    shards = synthetic.shard(records, 3)

    assert [len(s) for s in shards] == [4, 3, 3]
    assert sorted(json.dumps(r) for s in shards for r in s) == sorted(
        json.dumps(r) for r in records
    )


def test_write_jsonl_and_sharegpt_agree(tmp_path: Path) -> None:
    record = synthetic.make_examples(1, seed=0)[0]
    path = tmp_path / "data.jsonl"

    synthetic.write_jsonl([record, synthetic.to_sharegpt(record)], path)

    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[0] == record
    assert to_conversation(lines[1]) == to_conversation(record)
