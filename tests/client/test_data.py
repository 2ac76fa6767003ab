import json
from pathlib import Path

import pytest

from zoo_gym.client.data import DataError, load_records


def write(path: Path, *lines: str) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def test_all_three_formats_in_one_file(tmp_path: Path) -> None:
    path = write(
        tmp_path / "d.jsonl",
        json.dumps({"instruction": "Add 1 and 2.", "output": "3"}),
        json.dumps({"instruction": "Sum:", "input": "1 2", "output": "3"}),
        "",
        json.dumps(
            {
                "conversations": [
                    {"from": "system", "value": "S"},
                    {"from": "human", "value": "Q"},
                    {"from": "gpt", "value": "A"},
                ]
            }
        ),
        json.dumps(
            {"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]}
        ),
    )

    records = load_records(path)

    assert records == [
        [{"role": "user", "content": "Add 1 and 2."}, {"role": "assistant", "content": "3"}],
        [{"role": "user", "content": "Sum:\n\n1 2"}, {"role": "assistant", "content": "3"}],
        [
            {"role": "system", "content": "S"},
            {"role": "user", "content": "Q"},
            {"role": "assistant", "content": "A"},
        ],
        [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}],
    ]


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        ([], r"d.jsonl: the file has no examples; add one JSON object per line"),
        (
            ['{"instruction": "Q", "output": "A"}', "{not json"],
            r"d.jsonl:2: invalid JSON \(.* at column 2\); write one JSON object per line",
        ),
        (
            ['{"prompt": "Q", "completion": "A"}'],
            r"d.jsonl:1: unknown record format \(keys: completion, prompt\)",
        ),
        (
            ['{"instruction": "Q", "output": "  "}'],
            r"d.jsonl:1: the assistant output is empty; each line must be Alpaca",
        ),
        (['{"instruction": "Q"}'], r'd.jsonl:1: "output" is missing or not a string'),
        (
            ['{"conversations": [{"from": "bot", "value": "A"}]}'],
            r'd.jsonl:1: turn 0: "from" must be one of human, gpt, system',
        ),
        (
            ['{"messages": [{"role": "user", "content": "Q"}]}'],
            r"d.jsonl:1: the conversation must end with an assistant message",
        ),
        (["[1, 2]"], r'd.jsonl:1: message 0: "role" must be one of'),
    ],
)
def test_errors_are_one_line_with_file_and_line(
    tmp_path: Path, lines: list[str], message: str
) -> None:
    path = write(tmp_path / "d.jsonl", *lines)

    with pytest.raises(DataError, match=message) as info:
        load_records(path)

    assert "\n" not in str(info.value)
    assert str(info.value).startswith(str(path))


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"nope.jsonl: no such data file; pass --data"):
        load_records(tmp_path / "nope.jsonl")


def test_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_bytes(b"\xff\xfe\x00")

    with pytest.raises(DataError, match="it must be UTF-8 JSONL"):
        load_records(path)
