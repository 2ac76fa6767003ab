"""The OpenAI request bodies `gym-serve` accepts, and the response bodies it answers with.

Bodies follow OpenAI's API reference for `/v1/chat/completions` and `/v1/completions` (the
subset a served model can honour): fields this server does not implement are ignored, as vLLM
and llama.cpp's servers do, except `n` > 1, which would change the answer's shape and is refused.
"""

from __future__ import annotations

import secrets
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from zoo_gym.serving.engine import Done, Sampling

MAX_STOPS = 4  # OpenAI's limit on stop sequences
MAX_STOP_CHARS = 200
MAX_MESSAGES = 1024


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


Stop = (
    str
    | Annotated[list[Annotated[str, Field(max_length=MAX_STOP_CHARS)]], Field(max_length=MAX_STOPS)]
)


class SamplingBody(BaseModel):
    """What chat and text completions share."""

    model_config = ConfigDict(extra="ignore")
    model: str
    max_tokens: int | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: Literal[1] = 1
    stop: Stop | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None

    def requested_tokens(self) -> int | None:
        return self.max_tokens

    def sampling(self, max_tokens: int) -> Sampling:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return Sampling(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            seed=self.seed,
            stop=tuple(s for s in stops if s),
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatRequest(SamplingBody):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens

    def requested_tokens(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )

    def conversation(self) -> list[dict[str, str]]:
        """The messages as the chat template takes them (`developer` is a system message)."""
        return [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            for m in self.messages
        ]


class CompletionRequest(SamplingBody):
    prompt: str | list[str] | list[int]
    echo: bool = False

    def single_prompt(self) -> str | list[int]:
        """The one prompt, as text or token ids; ValueError for several prompts."""
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str):
            if len(self.prompt) != 1:
                raise ValueError("this server completes one prompt per request; send them apart")
            return str(self.prompt[0])
        return self.prompt  # type: ignore[return-value]


# --- responses ----------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def usage(done: Done) -> dict[str, int]:
    return {
        "prompt_tokens": done.prompt_tokens,
        "completion_tokens": done.completion_tokens,
        "total_tokens": done.prompt_tokens + done.completion_tokens,
    }


def chat_response(rid: str, model: str, text: str, done: Done) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": done.finish_reason,
            }
        ],
        "usage": usage(done),
    }


def completion_response(rid: str, model: str, text: str, done: Done) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {"index": 0, "text": text, "logprobs": None, "finish_reason": done.finish_reason}
        ],
        "usage": usage(done),
    }


def chat_chunk(
    rid: str, model: str, created: int, delta: dict[str, str], finish: str | None = None
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }


def completion_chunk(
    rid: str, model: str, created: int, text: str, finish: str | None = None
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
    }


def usage_chunk(rid: str, model: str, created: int, obj: str, done: Done) -> dict[str, Any]:
    """The last chunk with ``stream_options.include_usage``: no choices, the usage."""
    return {
        "id": rid,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage(done),
    }
