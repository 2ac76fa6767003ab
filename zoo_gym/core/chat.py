"""Conversations and the one tokenisation shared by training and evaluation.

A `Conversation` is a list of ``{"role", "content"}`` messages, the format of
``tokenizer.apply_chat_template``. Records arrive as Alpaca (``instruction``,
``input``, ``output``), ShareGPT (``conversations`` of ``from``/``value``) or
OpenAI-style ``messages``; `to_conversation` turns each into a `Conversation`.

Loss is taken on assistant tokens only (completion-only SFT, as in InstructGPT
[Ouyang et al., 2022]). The assistant spans are found by rendering the chat
template on growing prefixes of the conversation, so any template works, not
only ones with ``{% generation %}`` markers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

Message = dict[str, str]
Conversation = list[Message]
Prompt = tuple[Conversation, str]  # (the conversation up to the answer, the reference answer)

IGNORE_INDEX = -100
_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
_SHAREGPT_ROLES |= {"system": "system"}
_ROLES = {"system", "user", "assistant"}


def alpaca_to_conversation(record: Mapping[str, Any]) -> Conversation:
    """Alpaca record -> ``[user, assistant]``; a non-empty ``input`` follows the instruction."""
    instruction = _text(record, "instruction")
    extra = record.get("input") or ""
    if not isinstance(extra, str):
        raise ValueError('"input" must be a string')
    prompt = f"{instruction}\n\n{extra}" if extra.strip() else instruction
    return [
        {"role": "user", "content": prompt},
        {"role": "assistant", "content": _text(record, "output")},
    ]


def sharegpt_to_conversation(record: Mapping[str, Any]) -> Conversation:
    """ShareGPT record (``{"conversations": [{"from", "value"}]}``) -> `Conversation`."""
    turns = record["conversations"]
    if not isinstance(turns, list):
        raise ValueError('"conversations" must be a list of {"from", "value"} turns')
    conversation: Conversation = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, Mapping) or turn.get("from") not in _SHAREGPT_ROLES:
            raise ValueError(f'turn {i}: "from" must be one of human, gpt, system')
        conversation.append(
            {"role": _SHAREGPT_ROLES[turn["from"]], "content": _text(turn, "value")}
        )
    return conversation


def messages_to_conversation(record: Mapping[str, Any]) -> Conversation:
    """``{"messages": [{"role", "content"}]}`` -> `Conversation`."""
    turns = record["messages"]
    if not isinstance(turns, list):
        raise ValueError('"messages" must be a list of {"role", "content"} messages')
    conversation: Conversation = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, Mapping) or turn.get("role") not in _ROLES:
            raise ValueError(f'message {i}: "role" must be one of system, user, assistant')
        conversation.append({"role": turn["role"], "content": _text(turn, "content")})
    return conversation


def to_conversation(record: Mapping[str, Any] | Conversation) -> Conversation:
    """Detect the format of one record and convert it; `ValueError` says what is wrong.

    A valid conversation ends with a non-empty assistant message (the completion).
    """
    if isinstance(record, list):
        conversation = messages_to_conversation({"messages": record})
    elif not isinstance(record, Mapping):
        raise ValueError("a record must be a JSON object")
    elif "conversations" in record:
        conversation = sharegpt_to_conversation(record)
    elif "messages" in record:
        conversation = messages_to_conversation(record)
    elif "instruction" in record or "output" in record:
        conversation = alpaca_to_conversation(record)
    else:
        keys = ", ".join(sorted(record)) or "none"
        raise ValueError(
            f"unknown record format (keys: {keys}); expected Alpaca "
            '{"instruction", "input", "output"}, ShareGPT {"conversations"} or {"messages"}'
        )
    if not conversation or conversation[-1]["role"] != "assistant":
        raise ValueError("the conversation must end with an assistant message (the completion)")
    if not conversation[-1]["content"].strip():
        raise ValueError("the assistant output is empty")
    return conversation


def _text(record: Mapping[str, Any], key: str) -> str:
    value = record.get(key)
    if not isinstance(value, str):
        raise ValueError(f'"{key}" is missing or not a string')
    return value


def _render(tokenizer: Any, messages: Conversation, *, generation_prompt: bool) -> str:
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt
    )
    assert isinstance(text, str)
    return text


def encode_conversation(
    tokenizer: Any, conversation: Conversation, *, max_length: int
) -> tuple[list[int], list[int]]:
    """Token ids and labels for one conversation; labels are `IGNORE_INDEX` off assistant turns.

    The rendered text is cut into segments at the boundaries where the template
    opens and closes each assistant turn; each segment is tokenised on its own,
    so the labels mark exactly the tokens the model must produce after the
    generation prompt (including the end-of-turn token). Truncated on the right.
    """
    ids: list[int] = []
    labels: list[int] = []
    rendered = ""  # text already tokenised
    for i, message in enumerate(conversation):
        if message["role"] != "assistant":
            continue
        prompt = _render(tokenizer, conversation[:i], generation_prompt=True)
        full = _render(tokenizer, conversation[: i + 1], generation_prompt=False)
        if not (prompt.startswith(rendered) and full.startswith(prompt)):
            raise ValueError("the chat template does not render conversations prefix-consistently")
        prompt_ids = _tokens(tokenizer, prompt[len(rendered) :])
        completion_ids = _tokens(tokenizer, full[len(prompt) :])
        ids += prompt_ids + completion_ids
        labels += [IGNORE_INDEX] * len(prompt_ids) + completion_ids
        rendered = full
    return ids[:max_length], labels[:max_length]


def _tokens(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


@dataclass(frozen=True)
class Batch:
    """Right-padded batch: ``input_ids``, ``attention_mask`` and ``labels``, all `(b, t)`."""

    input_ids: Tensor
    attention_mask: Tensor
    labels: Tensor

    def to(self, device: str | torch.device) -> Batch:
        return Batch(
            self.input_ids.to(device), self.attention_mask.to(device), self.labels.to(device)
        )

    @property
    def num_tokens(self) -> int:
        return int(self.attention_mask.sum())


def collate(examples: Sequence[tuple[list[int], list[int]]], *, pad_id: int) -> Batch:
    """Pad `(ids, labels)` pairs on the right into one `Batch`."""
    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, (ids, labs) in enumerate(examples):
        input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        labels[row, : len(labs)] = torch.tensor(labs, dtype=torch.long)
        mask[row, : len(ids)] = 1
    return Batch(input_ids, mask, labels)


def token_nll(model: nn.Module, batch: Batch) -> tuple[Tensor, Tensor]:
    """Next-token NLL `(b, t - 1)` (zero off labelled tokens) and the label mask `(b, t - 1)`."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    targets = batch.labels[:, 1:]
    nll = nn.functional.cross_entropy(
        logits[:, :-1].float().transpose(1, 2),  # (b, vocab, t - 1)
        targets,
        ignore_index=IGNORE_INDEX,
        reduction="none",
    )
    return nll, targets != IGNORE_INDEX


def completion_nll(model: nn.Module, batch: Batch) -> tuple[Tensor, int]:
    """Summed next-token NLL over labelled tokens `()` and how many tokens were labelled."""
    nll, mask = token_nll(model, batch)
    return nll.sum(), int(mask.sum())


def pad_id_of(tokenizer: Any) -> int:
    """The tokenizer's pad id, falling back to eos (many base models have no pad token)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ValueError("the tokenizer has neither a pad nor an eos token")
    return int(pad)


def encode_prompt(tokenizer: Any, conversation: Conversation) -> list[int]:
    """Token ids of `conversation` followed by the generation prompt (for sampling a reply)."""
    return _tokens(tokenizer, _render(tokenizer, conversation, generation_prompt=True))


# --- prompts and completions (GRPO on the clients, the reward of a model on the coordinator) ---


def prompts_from_conversations(conversations: Sequence[Conversation]) -> list[Prompt]:
    """(prompt, answer) pairs: the conversation up to its last assistant turn, and that turn.

    >>> prompts_from_conversations([[{"role": "user", "content": "What is 1 + 2?"},
    ...                               {"role": "assistant", "content": "3"}]])
    [([{'role': 'user', 'content': 'What is 1 + 2?'}], '3')]
    """
    prompts: list[Prompt] = []
    for conversation in conversations:
        last = max(
            (i for i, m in enumerate(conversation) if m["role"] == "assistant"), default=None
        )
        if last is None or last == 0:
            continue  # nothing to answer, or nothing asked
        prompts.append((conversation[:last], conversation[last]["content"].strip()))
    return prompts


def left_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Left-padded ids `(n, p)` and attention mask `(n, p)`."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            ids[i, width - len(row) :] = torch.tensor(list(row), dtype=torch.long)
            mask[i, width - len(row) :] = 1
    return ids, mask


def completion_mask(completions: Tensor, eos_id: int) -> Tensor:
    """`(n, c)` mask of generated tokens up to and including the first EOS of each row."""
    is_eos = completions == eos_id
    after_eos = (is_eos.long().cumsum(dim=1) - is_eos.long()) > 0  # strictly after the first EOS
    return ~after_eos
