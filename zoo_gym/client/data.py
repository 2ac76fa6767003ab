"""Load a contributor's local training data.

JSONL, one example per line, in any of three formats, detected per line:

- Alpaca: ``{"instruction": ..., "input": ... (optional), "output": ...}``
- ShareGPT: ``{"conversations": [{"from": "human" | "gpt" | "system", "value": ...}]}``
- Messages: ``{"messages": [{"role": "user" | "assistant" | "system", "content": ...}]}``

Every record becomes a `Conversation` (``[{"role", "content"}, ...]``), the input
of ``tokenizer.apply_chat_template``. Bad data raises `DataError`, whose message
is one line naming the file, the line and what to fix.
"""

from __future__ import annotations

import json
from pathlib import Path

from zoo_gym.core.chat import Conversation, to_conversation

__all__ = ["Conversation", "DataError", "load_records"]

_FORMATS = (
    'Alpaca {"instruction", "input", "output"}, ShareGPT {"conversations": [...]} '
    'or {"messages": [...]}'
)


class DataError(ValueError):
    """The contributor's data file is missing, empty or malformed (one-line message)."""


def load_records(path: Path) -> list[Conversation]:
    """Read every non-blank line of the JSONL file `path` as a `Conversation`."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such data file; pass --data with a JSONL file of examples")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise DataError(f"{path}: cannot read the file ({error}); it must be UTF-8 JSONL") from None
    conversations: list[Conversation] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise DataError(
                f"{path}:{number}: invalid JSON ({error.msg} at column {error.colno}); "
                "write one JSON object per line"
            ) from None
        try:
            conversations.append(to_conversation(record))
        except ValueError as error:
            raise DataError(f"{path}:{number}: {error}; each line must be {_FORMATS}") from None
    if not conversations:
        raise DataError(f"{path}: the file has no examples; add one JSON object per line")
    return conversations
