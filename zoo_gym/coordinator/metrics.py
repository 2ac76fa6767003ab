"""Prometheus metrics of one coordinator, kept in its own `CollectorRegistry`.

The round loop and intake feed counters and histograms through the `observe_*` methods; what the
ledger holds is read from the database at scrape time, so those numbers are right after a restart
and never drift from the ledger.

    metric                                      type       fed by
    zoo_gym_round                               gauge      round_opened, observe_round
    zoo_gym_rounds_total{status}                counter    observe_round
    zoo_gym_round_seconds                       histogram  observe_round
    zoo_gym_submissions_received_total          counter    observe_submission
    zoo_gym_submissions_accepted_total          counter    observe_submission
    zoo_gym_submissions_rejected_total{reason}  counter    observe_submission
    zoo_gym_aggregation_seconds                 histogram  observe_aggregation
    zoo_gym_scoring_seconds                     histogram  observe_scoring
    zoo_gym_scoring_evaluations_total           counter    observe_scoring
    zoo_gym_scoring_backward_passes_total       counter    observe_scoring
    zoo_gym_scoring_fallbacks_total             counter    observe_scoring
    zoo_gym_ledger_entries                      gauge      scrape: Merkle log size
    zoo_gym_ledger_checkpoint_size              gauge      scrape: size of the latest checkpoint
    zoo_gym_ledger_rounds                       gauge      scrape: rounds in the ledger
    zoo_gym_contributors{status}                gauge      scrape: contributors per status
    zoo_gym_rounds_paused                       gauge      scrape: 1 while an operator paused rounds
    zoo_gym_round_loop_up                       gauge      scrape: 1 while the round loop runs or waits
    zoo_gym_tls_certificate_expiry_timestamp_seconds
                                                gauge      serve: the served certificate's notAfter

Rejection reasons are free text in the ledger; the `reason` label is one of `REJECT_REASONS`
(`reason_label` maps intake's messages onto them) so the label set stays small.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from zoo_gym import ledger
from zoo_gym.coordinator.control import RoundControl
from zoo_gym.coordinator.liveness import LoopHealth
from zoo_gym.ledger import Engine, Session

log = logging.getLogger(__name__)

REJECT_REASONS: tuple[str, ...] = (
    "unregistered",
    "identity",
    "signature",
    "banned",
    "pending",
    "round_closed",
    "stale_round",
    "stale_base",
    "deadline",
    "too_large",
    "digest",
    "envelope",
    "layout",
    "duplicate",
    "replay",
    "undecodable",
    "non_finite",
    "codec",
    "norm",
    "other",
)

# (substring of intake's message, label), first match wins
_REASON_PATTERNS: tuple[tuple[str, str], ...] = (
    ("not registered", "unregistered"),
    ("different contributor", "identity"),
    ("signature", "signature"),
    ("banned", "banned"),
    ("pending", "pending"),
    ("not open for submissions", "round_closed"),
    ("stale round", "stale_round"),
    ("stale base", "stale_base"),
    ("deadline", "deadline"),
    ("-byte limit", "too_large"),
    ("sha-256 differs", "digest"),
    ("envelope", "envelope"),
    ("names or shapes", "layout"),
    ("already have an accepted", "duplicate"),
    ("nonce", "replay"),
    ("could not be decoded", "undecodable"),
    ("nan or inf", "non_finite"),
    ("is encoded with", "codec"),
    ("norm bound", "norm"),
)

ROUND_BUCKETS = (1, 5, 15, 30, 60, 120, 300, 600, 1200, 3600, float("inf"))
AGGREGATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, float("inf"))


def reason_label(reason: str) -> str:
    """The `reason` label for a rejection: a label from `REJECT_REASONS` passes through, intake's
    messages map by keyword, anything else is "other"."""
    if reason in REJECT_REASONS:
        return reason
    text = reason.lower()
    for pattern, label in _REASON_PATTERNS:
        if pattern in text:
            return label
    return "other"


class _LedgerCollector(Collector):
    """Reads ledger counts at scrape time; a failing database drops these series, not the scrape."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        try:
            with Session(self.engine) as session:
                stats = ledger.ledger_stats(session)
        except Exception:
            log.warning("metrics: could not read the ledger", exc_info=True)
            return
        yield GaugeMetricFamily(
            "zoo_gym_ledger_entries", "entries in the Merkle log", stats.entries
        )
        yield GaugeMetricFamily(
            "zoo_gym_ledger_checkpoint_size",
            "tree size of the latest signed checkpoint",
            stats.checkpoint_size,
        )
        yield GaugeMetricFamily("zoo_gym_ledger_rounds", "rounds in the ledger", stats.rounds)
        contributors = GaugeMetricFamily(
            "zoo_gym_contributors", "registered contributors per status", labels=["status"]
        )
        for status in ("active", "pending", "banned"):
            contributors.add_metric([status], stats.contributors.get(status, 0))
        yield contributors


class _ControlCollector(Collector):
    def __init__(self, control: RoundControl) -> None:
        self.control = control

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "zoo_gym_rounds_paused",
            "1 while an operator has paused rounds",
            int(self.control.paused),
        )


class _LoopCollector(Collector):
    def __init__(self, health: LoopHealth) -> None:
        self.health = health

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "zoo_gym_round_loop_up",
            "1 while the round loop runs or waits for contributors; 0 once it stopped or crashed",
            int(self.health.status().healthy),
        )


class CoordinatorMetrics:
    """One coordinator's metrics. Thread-safe; every method is cheap and does no I/O."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.round = Gauge("zoo_gym_round", "number of the round under way or last run", registry=r)
        self.rounds = Counter(
            "zoo_gym_rounds", "rounds finished, by outcome", ["status"], registry=r
        )
        self.round_seconds = Histogram(
            "zoo_gym_round_seconds", "wall time of a round", buckets=ROUND_BUCKETS, registry=r
        )
        self.received = Counter(
            "zoo_gym_submissions_received", "submissions received by intake", registry=r
        )
        self.accepted = Counter(
            "zoo_gym_submissions_accepted", "submissions accepted by intake", registry=r
        )
        self.rejected = Counter(
            "zoo_gym_submissions_rejected",
            "submissions rejected, by reason",
            ["reason"],
            registry=r,
        )
        self.aggregation_seconds = Histogram(
            "zoo_gym_aggregation_seconds",
            "time to decode and aggregate a round's updates",
            buckets=AGGREGATION_BUCKETS,
            registry=r,
        )
        self.scoring_seconds = Histogram(
            "zoo_gym_scoring_seconds",
            "time to score a round's contributions",
            buckets=ROUND_BUCKETS,
            registry=r,
        )
        self.scoring_evaluations = Counter(
            "zoo_gym_scoring_evaluations",
            "validation evaluations spent scoring contributions",
            registry=r,
        )
        self.scoring_backward_passes = Counter(
            "zoo_gym_scoring_backward_passes",
            "backward passes at the base spent scoring contributions (first_order)",
            registry=r,
        )
        self.scoring_fallbacks = Counter(
            "zoo_gym_scoring_fallbacks",
            "rounds whose scoring ran out of scoring_seconds and fell back to first_order",
            registry=r,
        )
        self.tls_expiry = Gauge(
            "zoo_gym_tls_certificate_expiry_timestamp_seconds",
            "when the served TLS certificate expires (Unix time; 0 without TLS)",
            registry=r,
        )
        self._watched: set[str] = set()

    # -- fed by the round loop and intake ---------------------------------------------------------

    def round_opened(self, number: int) -> None:
        """Round `number` has started."""
        self.round.set(number)

    def observe_round(self, number: int, seconds: float, *, status: str) -> None:
        """Round `number` closed with `status` (published, rolled_back, aborted) after `seconds`."""
        self.round.set(number)
        self.rounds.labels(status=status).inc()
        self.round_seconds.observe(seconds)

    def observe_submission(self, *, accepted: bool, reason: str = "") -> None:
        """Intake decided about one submission; `reason` is why it was rejected."""
        self.received.inc()
        if accepted:
            self.accepted.inc()
        else:
            self.rejected.labels(reason=reason_label(reason)).inc()

    def observe_aggregation(self, seconds: float) -> None:
        """A round's decode-and-aggregate step took `seconds`."""
        self.aggregation_seconds.observe(seconds)

    def observe_scoring(
        self, seconds: float, *, evaluations: int, backward_passes: int, fell_back: bool
    ) -> None:
        """Scoring a round's contributions took `seconds`, `evaluations` validation evaluations
        and `backward_passes` backward passes; `fell_back` when its time budget ran out."""
        self.scoring_seconds.observe(seconds)
        self.scoring_evaluations.inc(evaluations)
        self.scoring_backward_passes.inc(backward_passes)
        if fell_back:
            self.scoring_fallbacks.inc()

    # -- read at scrape time ----------------------------------------------------------------------

    def watch_ledger(self, engine: Engine) -> None:
        """Report the ledger behind `engine` at every scrape (once per registry)."""
        if "ledger" not in self._watched:
            self.registry.register(_LedgerCollector(engine))
            self._watched.add("ledger")

    def watch_control(self, control: RoundControl) -> None:
        """Report whether `control` holds rounds paused (once per registry)."""
        if "control" not in self._watched:
            self.registry.register(_ControlCollector(control))
            self._watched.add("control")

    def watch_loop(self, health: LoopHealth) -> None:
        """Report whether the round loop behind `health` is up (once per registry)."""
        if "loop" not in self._watched:
            self.registry.register(_LoopCollector(health))
            self._watched.add("loop")

    def exposition(self) -> bytes:
        """The registry in Prometheus text format."""
        return generate_latest(self.registry)
