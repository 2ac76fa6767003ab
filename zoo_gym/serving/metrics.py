"""Prometheus metrics of one `gym-serve` process, in a registry of its own (``GET /metrics``).

The engine's counters and each served version's variant memory are read from the engine at
scrape time (`Engine.snapshot`); the two histograms are fed by the engine as it runs.

    metric                                              type       fed by
    zoo_gym_serve_requests_total                        counter    scrape: requests queued
    zoo_gym_serve_requests_finished_total{reason}       counter    scrape: stop, length, failed
    zoo_gym_serve_prompt_tokens_total                   counter    scrape: of finished requests
    zoo_gym_serve_completion_tokens_total               counter    scrape: tokens sampled
    zoo_gym_serve_forward_passes_total                  counter    scrape
    zoo_gym_serve_requests_running                      gauge      scrape: rows in the batch
    zoo_gym_serve_requests_waiting                      gauge      scrape: in the queue
    zoo_gym_serve_variants_reading                      gauge      scrape: admitted, being read
    zoo_gym_serve_variants_loaded{version}              gauge      scrape: per served version
    zoo_gym_serve_variants_pinned{version}              gauge      scrape
    zoo_gym_serve_variant_bytes{version}                gauge      scrape
    zoo_gym_serve_variant_budget_bytes{version}         gauge      scrape
    zoo_gym_serve_variant_hits_total{version}           counter    scrape
    zoo_gym_serve_variant_reads_total{version}          counter    scrape
    zoo_gym_serve_variant_failed_reads_total{version}   counter    scrape
    zoo_gym_serve_variant_evictions_total{version}      counter    scrape
    zoo_gym_serve_forward_seconds{phase}                histogram  engine: prefill, decode
    zoo_gym_serve_time_to_first_token_seconds           histogram  engine: queued to sampled

A decode step's `forward_seconds` is the time between two tokens of every row in it (the
sampling after it aside); `version` is a served version's name, never a variant's, so the
label set stays as small as the versions served.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from zoo_gym.serving.engine import Engine

PREFIX = "zoo_gym_serve"
FINISH_REASONS = ("stop", "length", "failed")
# seconds: a tiny model's step on a GPU to a long prefill on a CPU
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

_VARIANT_GAUGES = {
    "loaded": "variants_loaded",
    "pinned": "variants_pinned",
    "bytes": "variant_bytes",
    "budget_bytes": "variant_budget_bytes",
}
_VARIANT_COUNTERS = {
    "hits": "variant_hits",
    "loads": "variant_reads",
    "failed_reads": "variant_failed_reads",
    "evictions": "variant_evictions",
}


class ServingMetrics:
    """The metrics of `engine` (module docstring); `exposition()` is the text a scrape gets."""

    def __init__(self, engine: Engine) -> None:
        self.registry = CollectorRegistry()
        self.forward_seconds = Histogram(
            f"{PREFIX}_forward_seconds",
            "Seconds of each forward pass of a batch, by phase (prefill, decode)",
            ["phase"],
            buckets=BUCKETS,
            registry=self.registry,
        )
        self.first_token_seconds = Histogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "Seconds from a request's queueing to its first token sampled",
            buckets=BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_EngineCollector(engine))
        engine.stats.observe_forward = self.observe_forward
        engine.stats.observe_first_token = self.first_token_seconds.observe

    def observe_forward(self, phase: str, seconds: float) -> None:
        self.forward_seconds.labels(phase=phase).observe(seconds)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector(Collector):
    """Scrape-time figures of the engine (`Engine.snapshot`)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        figures = self.engine.snapshot()
        stats = self.engine.stats
        for name, value, about in (
            ("requests", figures["requests"], "Requests queued"),
            ("prompt_tokens", figures["prompt_tokens"], "Prompt tokens of the finished requests"),
            ("completion_tokens", figures["completion_tokens"], "Tokens sampled"),
            ("forward_passes", figures["forwards"], "Forward passes of a batch"),
        ):
            yield CounterMetricFamily(f"{PREFIX}_{name}", about, value=_number(value))
        finished = CounterMetricFamily(
            f"{PREFIX}_requests_finished", "Requests ended, by reason", labels=["reason"]
        )
        for reason in FINISH_REASONS:
            finished.add_metric([reason], stats.finished[reason])
        yield finished
        for name, key, about in (
            ("requests_running", "running", "Rows in the running batch"),
            ("requests_waiting", "waiting", "Requests in the queue"),
            ("variants_reading", "reading_variants", "Admitted requests whose variant is read"),
        ):
            yield GaugeMetricFamily(f"{PREFIX}_{name}", about, value=_number(figures[key]))
        yield from _variant_metrics(figures["variants"])


def _variant_metrics(stores: Any) -> Iterator[Metric]:
    """Each served version's variant memory, from its store's snapshot."""
    families: list[tuple[GaugeMetricFamily | CounterMetricFamily, str]] = []
    for kind, names in (
        (GaugeMetricFamily, _VARIANT_GAUGES),
        (CounterMetricFamily, _VARIANT_COUNTERS),
    ):
        for key, name in names.items():
            about = f"Variants of the served version: {key.replace('_', ' ')}"
            families.append((kind(f"{PREFIX}_{name}", about, labels=["version"]), key))
    for version, snapshot in sorted(stores.items()):
        for family, key in families:
            family.add_metric([version], snapshot[key])
    for family, _ in families:
        yield family


def _number(value: object) -> float:
    if not isinstance(value, int | float):
        raise TypeError(f"a metric's value is a number, not {value!r}")
    return float(value)
