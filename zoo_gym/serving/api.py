"""The OpenAI-compatible HTTP API of `gym-serve` (FastAPI).

- ``GET /v1/models``, ``GET /v1/models/{id}``: the served versions and variants.
- ``POST /v1/chat/completions``: the messages rendered with the model's chat template.
- ``POST /v1/completions``: a text prompt (or token ids) continued as it is.
- ``GET /stats``: the engine's counters (requests, forward passes by rows, queue).
- ``GET /metrics``: the same and the time of each forward pass and to each first token, for
  Prometheus (`zoo_gym.serving.metrics`).
- ``GET /health``: open, for probes.

With ``"stream": true`` an answer is a stream of server-sent events, ``data: {chunk}`` each,
ending with ``data: [DONE]``; a chat stream's first chunk carries the role, its last the
``finish_reason``, and with ``stream_options.include_usage`` one more chunk, with no choices,
carries the usage (as OpenAI's API does). An error after the stream began is one
``data: {"error": ...}`` event before ``[DONE]``.

Every route but `/health` needs an API key when the server has any (`api_guard`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from zoo_gym.core.chat import encode_prompt
from zoo_gym.serving import api_schemas as schemas
from zoo_gym.serving.api_guard import ApiError, BodyLimits, KeyCheck, error_body
from zoo_gym.serving.engine import (
    Delta,
    Done,
    Engine,
    EngineStopped,
    Event,
    Failed,
    QueueFull,
    RequestError,
    UnknownModel,
)
from zoo_gym.serving.engine_models import ServedModel
from zoo_gym.serving.metrics import ServingMetrics

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _engine_error(exc: RequestError) -> ApiError:
    if isinstance(exc, UnknownModel):
        return ApiError(404, str(exc), code="model_not_found", param="model")
    if isinstance(exc, QueueFull):
        return ApiError(
            429, str(exc), type="rate_limit_error", code="queue_full", headers={"Retry-After": "1"}
        )
    if isinstance(exc, EngineStopped):
        return ApiError(503, str(exc), type="server_error", code="stopping")
    return ApiError(400, str(exc))


_TYPE_ERRORS = {"string_type", "list_type", "dict_type", "model_type", "int_type", "float_type"}


def _telling(errors: Sequence[Any]) -> Any:
    """The error that says most: for a value of a union type (`stop`: a string or a list), the
    branch whose type matched and whose rule failed, not "should be a valid string"."""
    return next((e for e in errors if e.get("type") not in _TYPE_ERRORS), errors[0])


def _union_branch(part: str) -> bool:
    """Whether a location part names a union's branch (`str`, `list[...]`), not a field."""
    return "[" in part or part in ("str", "int", "float", "bool", "list", "dict")


def _handle_errors(app: FastAPI) -> None:
    def api_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ApiError)
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    def invalid(request: Request, exc: Exception) -> JSONResponse:
        """400 naming the first wrong field and its rule, never the value sent."""
        assert isinstance(exc, RequestValidationError)
        first = _telling(exc.errors())
        parts = [str(p) for p in first.get("loc", ()) if p != "body"]
        where = ".".join(p for p in parts if not _union_branch(p)) or "body"
        message = f"{where}: {first.get('msg', 'invalid')}"
        return JSONResponse(error_body(message, type="invalid_request_error", param=where), 400)

    def http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPException)
        message = exc.detail if isinstance(exc.detail, str) else "the request was refused"
        code = "not_found" if exc.status_code == 404 else None
        body = error_body(message, type="invalid_request_error", code=code)
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    def unexpected(request: Request, exc: Exception) -> JSONResponse:
        message = "the server failed on this request; its log has the details"
        return JSONResponse(error_body(message, type="server_error"), status_code=500)

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(RequestValidationError, invalid)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)


def _model_card(model: ServedModel) -> dict[str, Any]:
    return {
        "id": model.id,
        "object": "model",
        "created": model.created,
        "owned_by": "zoo-gym",
        "root": model.directory.name,  # the version whose files it loads
        "parent": model.parent,
        "max_model_len": model.context,
    }


def _authorized(request: Request) -> None:
    """Pass with an accepted API key (or when the server needs none); else ApiError."""
    keys: KeyCheck = request.app.state.keys
    keys.check(request.headers.get("authorization"), request.client.host if request.client else "")


KeyDep = Annotated[None, Depends(_authorized)]


class Answer:
    """The events of one generation, handed from the engine's thread to the event loop."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Event] = asyncio.Queue()

    def put(self, event: Event) -> None:  # on the engine's thread
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits for it any more
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)

    async def events(self) -> AsyncIterator[Event]:
        while True:
            event = await self.queue.get()
            yield event
            if not isinstance(event, Delta):
                return


def _sse(body: dict[str, Any] | str) -> bytes:
    text = body if isinstance(body, str) else json.dumps(body, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


def _failed(event: Failed) -> ApiError:
    return ApiError(500, event.message, type="server_error")


async def _collect(answer: Answer) -> tuple[str, Done]:
    parts = []
    async for event in answer.events():
        if isinstance(event, Delta):
            parts.append(event.text)
        elif isinstance(event, Failed):
            raise _failed(event)
        else:
            return "".join(parts), event
    raise AssertionError("an answer ends with Done or Failed")


Chunk = Callable[[str | None, str | None], dict[str, Any]]  # (text, finish_reason) -> chunk


async def _stream(
    answer: Answer,
    chunk: Chunk,
    usage: Callable[[Done], dict[str, Any]] | None,
    cancel: Callable[[], None],
) -> AsyncIterator[bytes]:
    try:
        async for event in answer.events():
            if isinstance(event, Delta):
                yield _sse(chunk(event.text, None))
            elif isinstance(event, Failed):
                yield _sse(_failed(event).body())
            else:
                yield _sse(chunk(None, event.finish_reason))
                if usage is not None:
                    yield _sse(usage(event))
        yield _sse("[DONE]")
    finally:
        cancel()  # the client went away (or the answer ended: then this does nothing)


class Routes:
    """The handlers, over one engine."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def start(
        self, body: schemas.SamplingBody, model: ServedModel, prompt: list[int]
    ) -> tuple[Answer, Callable[[], None]]:
        try:
            max_tokens = self.engine.check(model, prompt, body.requested_tokens())
            answer = Answer()
            gen = self.engine.submit(model, prompt, body.sampling(max_tokens), answer.put)
        except RequestError as exc:
            raise _engine_error(exc) from None
        return answer, gen.cancel

    def model(self, model_id: str) -> ServedModel:
        try:
            return self.engine.model(model_id)
        except UnknownModel as exc:
            raise _engine_error(exc) from None

    async def chat(self, body: schemas.ChatRequest) -> Any:
        model = self.model(body.model)
        if not getattr(model.tokenizer, "chat_template", None):
            raise ApiError(
                400, f"{model.id} has no chat template; use /v1/completions", param="model"
            )
        try:
            prompt = encode_prompt(model.tokenizer, body.conversation())
        except Exception as exc:  # the template refused the conversation (jinja raise_exception)
            raise ApiError(
                400, f"the chat template refused the messages: {exc}", param="messages"
            ) from None
        answer, cancel = self.start(body, model, prompt)
        rid, created = schemas.new_id("chatcmpl"), int(time.time())
        if not body.stream:
            text, done = await _collect(answer)
            return schemas.chat_response(rid, model.id, text, done)
        first = [True]

        def chunk(text: str | None, finish: str | None) -> dict[str, Any]:
            delta = {} if text is None else {"content": text}
            if first[0]:
                delta, first[0] = {"role": "assistant", **delta}, False
            return schemas.chat_chunk(rid, model.id, created, delta, finish)

        kind = "chat.completion.chunk"
        return _events(answer, chunk, cancel, body.include_usage, (rid, model.id, created, kind))

    async def complete(self, body: schemas.CompletionRequest) -> Any:
        model = self.model(body.model)
        try:
            prompt = body.single_prompt()
        except ValueError as exc:
            raise ApiError(400, str(exc), param="prompt") from None
        if isinstance(prompt, str):
            ids = list(model.tokenizer(prompt)["input_ids"])
        else:
            ids = prompt
            if any(not 0 <= t < len(model.tokenizer) for t in ids):
                raise ApiError(
                    400,
                    f"prompt: token ids run from 0 to {len(model.tokenizer) - 1}",
                    param="prompt",
                )
        answer, cancel = self.start(body, model, ids)
        rid, created = schemas.new_id("cmpl"), int(time.time())
        echo = prompt if body.echo and isinstance(prompt, str) else ""
        if not body.stream:
            text, done = await _collect(answer)
            return schemas.completion_response(rid, model.id, echo + text, done)
        sent_echo = [not echo]

        def chunk(text: str | None, finish: str | None) -> dict[str, Any]:
            if not sent_echo[0]:
                text, sent_echo[0] = echo + (text or ""), True
            return schemas.completion_chunk(rid, model.id, created, text or "", finish)

        kind = "text_completion"
        return _events(answer, chunk, cancel, body.include_usage, (rid, model.id, created, kind))


def _events(
    answer: Answer,
    chunk: Chunk,
    cancel: Callable[[], None],
    include_usage: bool,
    usage_head: tuple[str, str, int, str],
) -> StreamingResponse:
    """The answer as server-sent events: `chunk`s, then a usage chunk (id, model, created,
    object) when the client asked for one."""
    usage = (lambda d: schemas.usage_chunk(*usage_head, d)) if include_usage else None
    return StreamingResponse(
        _stream(answer, chunk, usage, cancel), media_type="text/event-stream", headers=SSE_HEADERS
    )


def create_app(
    engine: Engine,
    keys: KeyCheck,
    *,
    max_body_bytes: int = 1 << 20,
    read_timeout_s: float = 30.0,
) -> FastAPI:
    """The API over a started `engine`; requests need one of `keys` when it holds any."""
    app = FastAPI(
        title="zoo-gym serve",
        version="1",
        description="OpenAI-compatible API over published versions and their variants.",
        openapi_url=None,
        docs_url=None,
        redoc_url=None,
    )
    routes = Routes(engine)
    metrics = ServingMetrics(engine)
    app.state.keys = keys

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    def list_models(key: KeyDep) -> dict[str, Any]:
        return {"object": "list", "data": [_model_card(m) for m in engine.models.values()]}

    @app.get("/v1/models/{model_id}")
    def get_model(key: KeyDep, model_id: str) -> dict[str, Any]:
        return _model_card(routes.model(model_id))

    @app.get("/stats")
    def stats(key: KeyDep) -> dict[str, object]:
        return engine.snapshot()

    @app.get("/metrics", response_class=Response)
    def prometheus(key: KeyDep) -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(key: KeyDep, body: schemas.ChatRequest) -> Any:
        return await routes.chat(body)

    @app.post("/v1/completions", response_model=None)
    async def complete(key: KeyDep, body: schemas.CompletionRequest) -> Any:
        return await routes.complete(body)

    _handle_errors(app)
    app.add_middleware(BodyLimits, max_body_bytes=max_body_bytes, read_timeout_s=read_timeout_s)
    return app
