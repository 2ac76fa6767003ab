"""The serving engine in this process: continuous batching against Hugging Face's `generate`,
sampling and stop strings on hand-made values, and the limits it answers with."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from zoo_gym.core.identity import Identity
from zoo_gym.core.tiny import build_tiny_model
from zoo_gym.serving.api import create_app
from zoo_gym.serving.api_guard import KeyCheck
from zoo_gym.serving.engine import (
    Delta,
    Engine,
    EngineLimits,
    Event,
    QueueFull,
    RequestError,
    Sampling,
)
from zoo_gym.serving.engine_models import ServedModel, Weights, load_models
from zoo_gym.serving.engine_text import TextStream, held_back, new_generator, next_token


class Answer:
    """The events of one request, and a flag set at its end."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.ended = threading.Event()

    def __call__(self, event: Event) -> None:
        self.events.append(event)
        if not isinstance(event, Delta):
            self.ended.set()

    @property
    def text(self) -> str:
        return "".join(e.text for e in self.events if isinstance(e, Delta))


@pytest.fixture(scope="module")
def models(tiny_home_template: Path) -> dict[str, ServedModel]:
    """v0000 (verified) and `random`: other weights, the same tokenizer (long answers)."""
    key = Identity.load(tiny_home_template / "coordinator.key").public_key
    served = load_models(tiny_home_template / "models", coordinator_key=key)
    base = served["v0000"]
    model = build_tiny_model(vocab_size=len(base.tokenizer), seed=1).eval()
    served["random"] = dataclasses.replace(
        base, id="random", weights=Weights(model, base.weights.device)
    )
    return served


@pytest.fixture
def engine(models: dict[str, ServedModel]) -> Iterator[Engine]:
    running = Engine(models, EngineLimits(max_batch=4))
    running.start()
    yield running
    running.stop()


def greedy(model: ServedModel, ids: list[int], n: int) -> str:
    out = model.weights.model.generate(  # type: ignore[operator]
        torch.tensor([ids]), do_sample=False, max_new_tokens=n, pad_token_id=0
    )
    return str(model.tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True))


def test_requests_join_a_running_batch_and_answer_as_alone(
    engine: Engine, models: dict[str, ServedModel]
) -> None:
    model = models["random"]
    prompts = [model.tokenizer(p)["input_ids"] for p in ("1 2 3", "44", "What is 5 + 6?")]
    first, later = Answer(), [Answer(), Answer()]
    started = threading.Event()

    def sink(event: Event) -> None:
        first(event)
        if len(first.events) == 3:
            started.set()

    engine.submit(model, prompts[0], Sampling(max_tokens=40, temperature=0.0), sink)
    assert started.wait(60)
    for ids, answer in zip(prompts[1:], later, strict=True):
        engine.submit(model, ids, Sampling(max_tokens=20, temperature=0.0), answer)
    for answer in (first, *later):
        assert answer.ended.wait(60)

    stats = engine.snapshot()
    assert stats["rows_per_forward"]["3"] > 0  # type: ignore[index]  # all three in one step
    assert first.text == greedy(model, prompts[0], 40)
    assert [a.text for a in later] == [greedy(model, p, 20) for p in prompts[1:]]


def test_rows_of_two_models_decode_side_by_side(
    engine: Engine, models: dict[str, ServedModel]
) -> None:
    ids = models["v0000"].tokenizer("12 + 7 =")["input_ids"]
    answers = {name: Answer() for name in ("v0000", "random")}

    for name, answer in answers.items():
        engine.submit(models[name], ids, Sampling(max_tokens=12, temperature=0.0), answer)
    for answer in answers.values():
        assert answer.ended.wait(60)

    for name, answer in answers.items():
        assert answer.text == greedy(models[name], ids, 12)


def test_the_limits_refuse_in_one_line(models: dict[str, ServedModel]) -> None:
    engine = Engine(models, EngineLimits(max_prompt_tokens=8, max_new_tokens=16))
    model = models["v0000"]

    with pytest.raises(RequestError, match="the prompt has 9 tokens; this server takes at most 8"):
        engine.check(model, [5] * 9, 4)
    with pytest.raises(RequestError, match="max_tokens is 17; this server generates 1 to 16"):
        engine.check(model, [5], 17)
    assert engine.check(model, [5], None) == 16


def test_a_full_queue_is_429(models: dict[str, ServedModel]) -> None:
    engine = Engine(models, EngineLimits(max_queue=0))
    engine.start()
    try:
        with pytest.raises(QueueFull):
            engine.submit(models["v0000"], [5], Sampling(max_tokens=1), Answer())
        client = TestClient(create_app(engine, KeyCheck([])))
        reply = client.post("/v1/completions", json={"model": "v0000", "prompt": "1"})
    finally:
        engine.stop()

    assert reply.status_code == 429
    assert reply.headers["retry-after"] == "1"
    assert reply.json()["error"]["code"] == "queue_full"


# --- tokens and text ----------------------------------------------------------------------------


def test_greedy_picks_the_largest_logit() -> None:
    logits = torch.tensor([0.5, 3.0, -1.0, 2.9])

    assert next_token(logits, temperature=0.0, top_p=1.0, generator=new_generator(0)) == 1


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    # probabilities 0.6, 0.3, 0.1: top_p 0.5 keeps only the first, 0.8 the first two
    logits = torch.tensor([0.6, 0.3, 0.1]).log()
    generator = new_generator(0)

    alone = {next_token(logits, temperature=1.0, top_p=0.5, generator=generator) for _ in range(50)}
    two = {next_token(logits, temperature=1.0, top_p=0.8, generator=generator) for _ in range(200)}

    assert alone == {0}
    assert two == {0, 1}


def test_a_seed_fixes_the_draws() -> None:
    logits = torch.zeros(50)

    def draws(seed: int) -> list[int]:
        g = new_generator(seed)
        return [next_token(logits, temperature=1.0, top_p=1.0, generator=g) for _ in range(10)]

    assert draws(3) == draws(3)
    assert draws(3) != draws(4)


def test_text_that_may_become_a_stop_string_is_held_back(models: dict[str, ServedModel]) -> None:
    tokenizer = models["v0000"].tokenizer
    ids = tokenizer("12 + 7 = 19.", add_special_tokens=False)["input_ids"]
    stream = TextStream(tokenizer, ("= 19",))

    released = [stream.push(t) for t in ids]

    text = "".join(part for part, _ in released)
    assert text == "12 + 7 "  # "=" waited, then "= 19" stopped the answer
    assert [stopped for _, stopped in released].index(True) == len(released) - 2
    assert held_back("12 + 7 =", ("= 19",)) == 1
    assert held_back("ab\ufffd", ()) == 1
