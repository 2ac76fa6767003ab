"""Generation for many requests at once: one scheduler thread, continuous batching, a KV cache.

Requests wait in a bounded queue. Between two decode steps the scheduler admits waiting
requests into the running batch (up to `max_batch` rows over all models) in the order they
came: their prompts are prefilled together, left-padded, and their KV cache is joined to the
running one, left-padded to a common width. A request for a variant waits, and those behind it
with it, while its variant and the variants pinned on the same weights (those of the running
rows and of the requests admitted before it) do not fit in those weights' variant memory
together (`VariantStore.reserve`): the batch never reads a variant again while it runs. A
variant that is not in memory is read on a thread of its own once its request is admitted;
the running rows decode meanwhile (on the CPU more slowly: the read takes a core from the
forward's threads), and the request joins the batch at the first step after the read. One that
cannot be read fails that request alone.

Every row keeps its own count of real tokens, which gives its position ids and attention mask,
so rows that started at different times decode in one forward pass. A row leaves the batch when
its request ends (EOS, a stop string, `max_tokens`, or its client went away); the padding
columns no row needs any more are dropped.

Rows of models that share `Weights` run in the same forward pass; `Weights.assign` receives
each row's variant around it (`engine_models`). Rows on different weights run one forward
pass per weights per step.

Each request has a sink, called on the scheduler thread with `Delta` (text that is final),
then one `Done` (finish reason and token counts) or `Failed` (and only `Failed`, from any thread
that stops the engine, for a request that had not started).
"""

from __future__ import annotations

import inspect
import itertools
import logging
import queue
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor
from transformers import DynamicCache

from zoo_gym.core.chat import left_pad, pad_id_of
from zoo_gym.serving.engine_models import ServedModel, Weights
from zoo_gym.serving.engine_text import TextStream, new_generator, next_token
from zoo_gym.serving.variants import VariantError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineLimits:
    """What the engine accepts; every limit is on by default."""

    max_batch: int = 8  # rows decoded together, over all models
    max_prompt_tokens: int = 2048
    max_new_tokens: int = 512
    max_queue: int = 64  # requests waiting to be admitted
    batch_wait_s: float = 0.0  # an idle engine waits this long for more requests to batch


@dataclass(frozen=True)
class Sampling:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()


@dataclass(frozen=True)
class Delta:
    text: str


@dataclass(frozen=True)
class Done:
    finish_reason: str  # "stop" (EOS or a stop string) or "length" (max_tokens)
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class Failed:
    message: str


Event = Delta | Done | Failed


class RequestError(ValueError):
    """A request the engine refuses as it is (too long, too many tokens asked)."""


class UnknownModel(RequestError):
    """The request names a model that is not served."""


class QueueFull(RequestError):
    """Too many requests wait already."""


class EngineStopped(RequestError):
    """The engine is not running."""


@dataclass(eq=False)
class Generation:
    """One request: what to complete, how, and where its events go."""

    id: int
    model: ServedModel
    prompt: list[int]
    sampling: Sampling
    sink: Callable[[Event], None]
    queued_at: float = field(default_factory=time.monotonic)
    cancelled: bool = False
    ended: bool = False
    pinned: bool = False  # its variant is pinned in its weights' store for it
    unreadable: Failed | None = None  # why its variant could not be read

    def cancel(self) -> None:
        """Stop generating (the client went away); the row leaves at the next step."""
        self.cancelled = True

    def emit(self, event: Event) -> None:
        """Pass `event` to the sink; nothing after the first `Done` or `Failed`, which unpins
        the request's variant."""
        if self.ended:
            return
        self.ended = not isinstance(event, Delta)
        if self.ended:
            self.release()
        self.sink(event)

    def reserve(self) -> bool:
        """Pin this request's variant in its store (`VariantStore.reserve`), if it has one;
        False when it does not fit beside the variants pinned there now."""
        store, variant = self.model.weights.store, self.model.variant
        if store is None or variant is None or self.pinned:
            return True
        self.pinned = store.reserve(variant)
        return self.pinned

    def release(self) -> None:
        """Unpin this request's variant (once)."""
        store, variant = self.model.weights.store, self.model.variant
        if self.pinned and store is not None and variant is not None:
            self.pinned = False
            store.release(variant)

    def needs_read(self) -> bool:
        """Whether its variant has yet to be read into memory."""
        store, variant = self.model.weights.store, self.model.variant
        return store is not None and variant is not None and variant not in store


@dataclass(eq=False)
class Row:
    """A running generation in its lane's batch."""

    gen: Generation
    text: TextStream
    generator: torch.Generator
    length: int  # real tokens in the KV cache
    token: int = -1  # the last token sampled, not yet in the cache
    done: bool = False


@dataclass
class EngineStats:
    """The engine's counters, and what it tells `observe_forward` (phase, seconds of each
    forward pass) and `observe_first_token` (seconds from a request's queueing to its first
    token) where they are set (`zoo_gym.serving.metrics`)."""

    requests: int = 0
    prompt_tokens: int = 0  # of the requests finished
    completion_tokens: int = 0
    forwards: int = 0
    rows_per_forward: Counter[int] = field(default_factory=Counter)
    finished: Counter[str] = field(default_factory=Counter)  # finish reason, or "failed"
    observe_forward: Callable[[str, float], None] | None = None
    observe_first_token: Callable[[float], None] | None = None

    def count(self, event: Event) -> None:
        """Count a request's last event."""
        if isinstance(event, Done):
            self.finished[event.finish_reason] += 1
            self.prompt_tokens += event.prompt_tokens
        elif isinstance(event, Failed):
            self.finished["failed"] += 1

    def snapshot(self, *, running: int, waiting: int) -> dict[str, object]:
        return {
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "finished": dict(sorted(self.finished.items())),
            "forwards": self.forwards,
            "max_rows": max(self.rows_per_forward, default=0),
            "rows_per_forward": {str(k): v for k, v in sorted(self.rows_per_forward.items())},
            "running": running,
            "waiting": waiting,
        }


def _positions(lengths: Tensor, width: int) -> Tensor:
    """`(b, width)` mask of the real tokens when row i's `lengths[i]` tokens are right-aligned."""
    return (torch.arange(width) >= (width - lengths)[:, None]).long()


def _layers(cache: DynamicCache) -> list[tuple[Tensor, Tensor]]:
    """(keys, values) `(b, heads, t, d)` of each layer of `cache`."""
    out = []
    for layer in cache.layers:
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if not isinstance(keys, Tensor) or not isinstance(values, Tensor):
            raise TypeError("the engine batches caches of attention keys and values only")
        out.append((keys, values))
    return out


def _pad_cache(cache: DynamicCache, columns: int) -> list[tuple[Tensor, Tensor]]:
    """The (keys, values) of each layer with `columns` zero columns on the left."""
    pad = (0, 0, columns, 0)
    return [
        (torch.nn.functional.pad(k, pad), torch.nn.functional.pad(v, pad))
        for k, v in _layers(cache)
    ]


class Lane:
    """The running batch of one `Weights`: rows, their KV cache and its width."""

    def __init__(self, weights: Weights, stats: EngineStats) -> None:
        self.weights = weights
        self.stats = stats
        self.rows: list[Row] = []
        self.cache: DynamicCache | None = None
        self.width = 0
        # transformers 5.2x renames `past_key_values` to `cache`; either works here
        forward = inspect.signature(weights.model.forward).parameters
        self.cache_argument = "cache" if "cache" in forward else "past_key_values"

    def _forward(
        self,
        phase: str,
        gens: Sequence[Generation],
        ids: Tensor,
        mask: Tensor,
        positions: Tensor,
        cache: DynamicCache,
    ) -> Tensor:
        """Last-position logits `(b, vocab)` of `gens`' rows, float32 on the CPU; `cache` grows
        by `ids` `(b, t)`."""
        device = self.weights.device
        self.stats.forwards += 1
        self.stats.rows_per_forward[ids.shape[0]] += 1
        began = time.monotonic()
        with self.weights.assign([g.model.variant for g in gens]):
            out = self.weights.model(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                position_ids=positions.to(device),
                use_cache=True,
                logits_to_keep=1,
                **{self.cache_argument: cache},
            )
        logits: Tensor = out.logits[:, -1].float().cpu()
        if self.stats.observe_forward is not None:  # the logits on the CPU: the pass is over
            self.stats.observe_forward(phase, time.monotonic() - began)
        return logits

    def admit(self, gens: Sequence[Generation]) -> list[Row]:
        """Prefill `gens` together and join them to the batch; returns their rows."""
        tokenizer = gens[0].model.tokenizer
        ids, mask = left_pad([g.prompt for g in gens], pad_id_of(tokenizer))
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
        cache = DynamicCache()
        logits = self._forward("prefill", gens, ids, mask, positions, cache)
        rows = [
            Row(
                g,
                TextStream(g.model.tokenizer, g.sampling.stop),
                new_generator(g.sampling.seed),
                len(g.prompt),
            )
            for g in gens
        ]
        self._join(rows, cache, ids.shape[1])
        self._sample(rows, logits)
        if self.stats.observe_first_token is not None:
            now = time.monotonic()
            for g in gens:
                self.stats.observe_first_token(now - g.queued_at)
        return rows

    def _join(self, rows: list[Row], cache: DynamicCache, width: int) -> None:
        if self.cache is None or not self.rows:
            self.rows, self.cache, self.width = rows, cache, width
            return
        common = max(width, self.width)
        old, new = _pad_cache(self.cache, common - self.width), _pad_cache(cache, common - width)
        joined = [
            (torch.cat([k0, k1]), torch.cat([v0, v1]))
            for (k0, v0), (k1, v1) in zip(old, new, strict=True)
        ]
        self.cache = DynamicCache(ddp_cache_data=joined)
        self.rows, self.width = self.rows + rows, common

    def decode(self) -> None:
        """One decode step for every row: feed each row's last token, sample its next."""
        assert self.cache is not None
        lengths = torch.tensor([r.length for r in self.rows])
        ids = torch.tensor([[r.token] for r in self.rows])
        mask = _positions(lengths + 1, self.width + 1)
        gens = [r.gen for r in self.rows]
        logits = self._forward("decode", gens, ids, mask, lengths[:, None], self.cache)
        self.width += 1
        for row in self.rows:
            row.length += 1
        self._sample(self.rows, logits)

    def _sample(self, rows: Sequence[Row], logits: Tensor) -> None:
        for row, row_logits in zip(rows, logits, strict=True):
            if not row.gen.cancelled:
                _sample(row, row_logits)
                self.stats.completion_tokens += 1

    def drop_finished(self) -> None:
        """Remove rows that are done or cancelled, and the left columns no row needs."""
        keep = [i for i, r in enumerate(self.rows) if not (r.done or r.gen.cancelled)]
        if len(keep) == len(self.rows):
            return
        for row in self.rows:
            if row.done or row.gen.cancelled:
                row.gen.release()
        self.rows = [self.rows[i] for i in keep]
        if not self.rows or self.cache is None:
            self.rows, self.cache, self.width = [], None, 0
            return
        unused = self.width - max(r.length for r in self.rows)
        index = torch.tensor(keep, device=self.weights.device)
        self.cache = DynamicCache(
            ddp_cache_data=[
                (k[index, :, unused:], v[index, :, unused:]) for k, v in _layers(self.cache)
            ]
        )
        self.width -= unused

    def fail(self, message: str) -> None:
        for row in self.rows:
            row.gen.emit(Failed(message))  # unpins its variant, or did at its end already
        self.rows, self.cache, self.width = [], None, 0


def _sample(row: Row, logits: Tensor) -> None:
    """Choose the row's next token and tell its sink what it adds; mark the row done at the
    end of its completion."""
    s = row.gen.sampling
    token = next_token(logits, temperature=s.temperature, top_p=s.top_p, generator=row.generator)
    row.token = token
    finish, eos = None, token in row.gen.model.eos_ids
    if eos:
        finish, text = "stop", row.text.rest()
    else:
        text, stopped = row.text.push(token)
        if stopped:
            finish = "stop"
        elif len(row.text.ids) >= s.max_tokens:
            finish, text = "length", text + row.text.rest()
    if text:
        row.gen.emit(Delta(text))
    if finish is not None:
        row.done = True
        completion = len(row.text.ids) + eos  # the EOS token counts, as in OpenAI's usage
        row.gen.emit(Done(finish, len(row.gen.prompt), completion))


class Engine:
    """Served models, the request queue and the scheduler thread that decodes them."""

    def __init__(self, models: dict[str, ServedModel], limits: EngineLimits | None = None) -> None:
        self.models = models
        self.limits = limits or EngineLimits()
        self.stats = EngineStats()
        self._lanes: dict[int, Lane] = {}
        for m in models.values():
            self._lanes.setdefault(id(m.weights), Lane(m.weights, self.stats))
        self._waiting: deque[Generation] = deque()
        # admitted requests whose variant is read meanwhile; those read go to `_read` too
        self._reading: set[Generation] = set()
        self._read: list[Generation] = []
        self._reads: queue.SimpleQueue[Generation | None] = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._ids = itertools.count(1)
        self._running = False
        self._thread: threading.Thread | None = None
        self._reader: threading.Thread | None = None

    # --- the callers' side (any thread) -------------------------------------------------------

    def model(self, model_id: str) -> ServedModel:
        try:
            return self.models[model_id]
        except KeyError:
            raise UnknownModel(
                f"the model `{model_id}` does not exist; GET /v1/models lists the served ones"
            ) from None

    def check(self, model: ServedModel, prompt: Sequence[int], max_tokens: int | None) -> int:
        """`max_tokens` as it will be used (the room left when None); RequestError when the
        prompt or the completion asked for does not fit the limits or the model's context."""
        limits, room = self.limits, model.context - len(prompt)
        if not prompt:
            raise RequestError("the prompt is empty; send at least one token of text")
        if len(prompt) > limits.max_prompt_tokens or room < 1:
            most = min(limits.max_prompt_tokens, model.context - 1)
            raise RequestError(
                f"the prompt has {len(prompt)} tokens; this server takes at most {most}"
            )
        if max_tokens is None:
            return min(limits.max_new_tokens, room)
        if max_tokens < 1 or max_tokens > limits.max_new_tokens:
            raise RequestError(
                f"max_tokens is {max_tokens}; this server generates 1 to {limits.max_new_tokens}"
            )
        if max_tokens > room:
            raise RequestError(
                f"{model.id}'s context is {model.context} tokens; the prompt ({len(prompt)}) "
                f"and max_tokens ({max_tokens}) exceed it by {max_tokens - room}"
            )
        return max_tokens

    def submit(
        self,
        model: ServedModel,
        prompt: list[int],
        sampling: Sampling,
        sink: Callable[[Event], None],
    ) -> Generation:
        """Queue a checked request (`check`); QueueFull or EngineStopped when it cannot wait."""
        stats = self.stats

        def counted(event: Event) -> None:
            if not isinstance(event, Delta):
                stats.count(event)
            sink(event)

        gen = Generation(next(self._ids), model, prompt, sampling, counted)
        with self._cond:
            if not self._running:
                raise EngineStopped("the server is stopping; retry against a running one")
            if len(self._waiting) >= self.limits.max_queue:
                raise QueueFull(
                    f"{len(self._waiting)} requests are waiting already, the most this server "
                    "queues; retry in a few seconds"
                )
            self._waiting.append(gen)
            self.stats.requests += 1
            self._cond.notify()
        return gen

    def snapshot(self) -> dict[str, object]:
        with self._cond:
            waiting, reading = len(self._waiting), len(self._reading)
        running = sum(len(lane.rows) for lane in self._lanes.values())
        figures = self.stats.snapshot(running=running, waiting=waiting)
        figures["reading_variants"] = reading
        stores = [lane.weights.store for lane in self._lanes.values()]
        figures["variants"] = {s.base: s.snapshot() for s in stores if s is not None}
        return figures

    # --- the scheduler thread -----------------------------------------------------------------

    def start(self) -> None:
        with self._cond:
            self._running = True
        self._thread = threading.Thread(target=self._loop, name="serving-engine", daemon=True)
        self._reads = queue.SimpleQueue()  # its own: a reader of an earlier start may go on
        self._reader = threading.Thread(
            target=self._read_variants, args=(self._reads,), name="serving-variants", daemon=True
        )
        self._thread.start()
        self._reader.start()

    def stop(self) -> None:
        """Stop after the current step; waiting and running requests fail with one line."""
        with self._cond:
            self._running = False
            self._cond.notify()
        self._reads.put(None)  # the reader ends after the read it is in, unwaited for
        if self._thread is not None:
            self._thread.join(timeout=30)
        with self._cond:
            unstarted = [*self._waiting, *self._reading]
            self._waiting.clear()
            self._reading.clear()
            self._read.clear()
        for gen in unstarted:
            if not gen.cancelled:
                gen.emit(Failed("the server stopped before this request started"))
            gen.release()
        for lane in self._lanes.values():
            lane.fail("the server stopped during this request")

    def _running_rows(self) -> int:
        return sum(len(lane.rows) for lane in self._lanes.values())

    def _next_admitted(self) -> list[Generation] | None:
        """Wait for work; the requests to prefill now, those whose variant could not be read
        among them (None: the engine stops)."""
        with self._cond:
            while self._running:
                idle = not self._running_rows() and not self._reading
                if idle and self._waiting and self.limits.batch_wait_s > 0:
                    self._wait_for_batch()
                admitted = self._take_read() + self._admit_waiting()
                if admitted or self._running_rows():
                    return admitted
                self._cond.wait()  # for a request, or a variant's read to end
            return None

    def _wait_for_batch(self) -> None:
        """An idle engine waits up to `batch_wait_s` for a batch's worth of requests."""
        room = self.limits.max_batch
        deadline = time.monotonic() + self.limits.batch_wait_s
        while self._running and len(self._waiting) < room:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._cond.wait(left)

    def _take_read(self) -> list[Generation]:
        """The admitted requests whose variant's read has ended."""
        read, self._read = self._read, []
        self._reading.difference_update(read)
        return read

    def _admit_waiting(self) -> list[Generation]:
        """Waiting requests in the order they came, while there is room in the batch and each
        one's variant fits beside those pinned; one whose variant is not in memory is handed
        to the reader, and joins once it is read."""
        room = self.limits.max_batch - self._running_rows() - len(self._reading)
        admitted: list[Generation] = []
        while self._waiting and room > 0:
            gen = self._waiting[0]
            if not gen.cancelled and not gen.reserve():
                break  # first come, first served: it waits for rows of others to end
            self._waiting.popleft()
            if gen.cancelled:
                continue
            room -= 1
            if gen.needs_read():
                self._reading.add(gen)
                self._reads.put(gen)
            else:
                admitted.append(gen)
        return admitted

    def _read_variants(self, reads: queue.SimpleQueue[Generation | None]) -> None:
        """The reader thread: reads the variants of admitted requests, one at a time."""
        while (gen := reads.get()) is not None:
            gen.unreadable = _variant_read(gen)
            with self._cond:
                if gen in self._reading:
                    self._read.append(gen)
                    self._cond.notify()

    def _loop(self) -> None:
        with torch.inference_mode():
            while (admitted := self._next_admitted()) is not None:
                try:
                    self._step(admitted)
                except Exception:  # a failing step must not stop the server
                    log.exception("a decode step failed; its requests were answered with an error")
                    for gen in admitted:
                        gen.emit(Failed("the server failed on this request; its log says why"))
                    for lane in self._lanes.values():
                        lane.fail("the server failed on this request; its log says why")

    def _step(self, admitted: list[Generation]) -> None:
        """One decode step for every running row, then the prefill of `admitted` (one per
        weights and pad id), whose rows join the next step."""
        for lane in self._lanes.values():
            lane.drop_finished()  # rows cancelled while waiting for this step
            if lane.rows:
                lane.decode()
                lane.drop_finished()
        by_lane: dict[int, list[Generation]] = {}
        for gen in admitted:
            if gen.unreadable is not None:
                gen.emit(gen.unreadable)
            elif gen.cancelled:
                gen.release()
            else:
                by_lane.setdefault(id(gen.model.weights), []).append(gen)
        for key, gens in by_lane.items():
            for group in _by_pad(gens):
                self._lanes[key].admit(group)
            self._lanes[key].drop_finished()


def _variant_read(gen: Generation) -> Failed | None:
    """Read `gen`'s variant into its store ahead of its prefill; what its request fails with
    where it cannot be read (the log says why; the client is not told the server's paths):
    that request alone fails, not the batch it would have joined."""
    store, variant = gen.model.weights.store, gen.model.variant
    if store is None or variant is None:
        return None
    try:
        store.get(variant)
    except VariantError as exc:
        log.warning("request for %s refused: %s", gen.model.id, exc)
        return Failed(
            f"the variant {gen.model.id} cannot be read on this server now; its log says why"
        )
    except Exception:  # the reader thread goes on for the other requests
        log.exception("reading the variant of %s failed", gen.model.id)
        return Failed("the server failed on this request; its log says why")
    return None


def _by_pad(gens: list[Generation]) -> list[list[Generation]]:
    """`gens` grouped by pad id (one prefill pads with one id)."""
    groups: dict[int, list[Generation]] = {}
    for gen in gens:
        groups.setdefault(pad_id_of(gen.model.tokenizer), []).append(gen)
    return list(groups.values())
