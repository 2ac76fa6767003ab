"""Flower strategy adapter: Flower's FedAvg with zoo-gym's task and aggregation.

Node sampling is ours (uniform, or
weighted by reputation, `sample`), and so is the rest of what must be ours: the
task carries a round config and a model *version* (contributors fetch
weights once per version, not per message), and aggregation runs the configured
robust rule over the accepted envelopes, whose per-update decisions go to the ledger.

Aggregation memory is bounded by `memory` (the `aggregation_memory` setting): when the
decoded `(n, d)` float32 updates fit in a third of it (a rule over a tensor may make up to two
working copies of it: sorted values, a Gram pass), the envelopes are decoded straight into one
preallocated buffer; when they do not, the payloads stay compressed in memory and the rule
reads column chunks of all n updates decoded at a time (`PayloadColumns`, chunks within
that budget), so n x d never has to fit. BitDelta payloads with float16 scales (the
contributors' default) stay compressed on the CPU whatever their size: the rules read their
sign bits and scales without decoding a value (`zoo_gym.aggregation.reads_sign_bits`), faster
than decoding them first.

Decoding and aggregation run on the coordinator's `device` ("auto": the first CUDA device when
PyTorch sees one, else the CPU). On CUDA the envelopes are decoded (and, for fused FedAvg,
accumulated) by the Triton kernels (`zoo_gym.compression.kernels.active_for`), and a column
source over BitDelta payloads holds their signs and scales on the GPU, decoding each chunk
there; the round's update and rows come back to the CPU. On the CPU nothing changes.
"""

from __future__ import annotations

import hashlib
import logging
import math
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from zoo_gym import ledger
from zoo_gym.aggregation import (
    WEIGHTED_RULES,
    Aggregate,
    Decision,
    aggregate,
    min_clients,
    reads_sign_bits,
)
from zoo_gym.aggregation.columns import Columns
from zoo_gym.aggregation.fedavg import fedavg_decisions
from zoo_gym.compression import (
    EnvelopeError,
    EnvelopeHeader,
    decode_accumulate,
    decode_into,
    kernels,
)
from zoo_gym.compression.columns import PayloadColumns
from zoo_gym.coordinator.backend import CoordinatorBackend
from zoo_gym.coordinator.config import DEFAULT_AGGREGATION_MEMORY
from zoo_gym.core.delta import Layout, numel, unflatten
from zoo_gym.core.identity import node_id
from zoo_gym.core.phases import phase
from zoo_gym.core.protocol import SUBMISSION, TASK_CONFIG, TRAIN_METRICS, IntakeResult
from zoo_gym.ledger import Session
from zoo_gym.scoring import influence_weights, sample_contributors

log = logging.getLogger(__name__)

RAW_CODECS = frozenset({"none", "fp16", "bf16"})  # values sent as they are: may be NaN or Inf


@dataclass
class RoundAggregate:
    """What one round's aggregation produced."""

    update: dict[str, torch.Tensor]
    contributors: tuple[str, ...]  # whose updates the rule used
    received: int
    accepted: int
    rows: torch.Tensor | Columns | None = None  # (n, d): the updates the rule saw
    row_contributors: tuple[str, ...] = ()  # contributor of each row
    decisions: tuple[Decision, ...] = ()  # the rule's decision about each row


def selection_seed(run_seed: int, server_round: int) -> int:
    """The seed of round `server_round`'s draw of contributors (see `ZooStrategy.sample`)."""
    digest = hashlib.sha256(f"zoo-gym/selection|{run_seed}|{server_round}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


class ZooStrategy(FedAvg):
    def __init__(
        self,
        backend: CoordinatorBackend,
        *,
        rule: str,
        f: int,
        params: dict[str, float | int] | None = None,
        pre: str | None = None,
        min_clients: int,
        clients_per_round: int,
        quorum: int,
        wait_for_clients_s: float,
        stop: threading.Event,
        layout: Callable[[], Layout],
        selection_floor: float = 0.0,
        keep_rows: bool = True,
        trusted_reputation: float = 0.0,
        fresh_weight: float = 1.0,
        device: str = "auto",
        memory: int = DEFAULT_AGGREGATION_MEMORY,
        seed: int | None = None,
    ) -> None:
        super().__init__(
            fraction_train=1.0,
            fraction_evaluate=0.0,
            min_train_nodes=min_clients,
            min_available_nodes=min_clients,
            configrecord_key=TASK_CONFIG,
        )
        self.backend = backend
        self.rule = rule
        self.f = f
        self.params: dict[str, Any] = dict(params or {})
        self.pre = pre
        self.clients_per_round = clients_per_round
        self.quorum = quorum
        self.wait_for_clients_s = wait_for_clients_s
        self.stop = stop
        self.layout = layout
        self.selection_floor = selection_floor
        self.keep_rows = (
            keep_rows  # scoring needs every decoded update; plain FedAvg alone does not
        )
        self.trusted_reputation = trusted_reputation
        self.fresh_weight = fresh_weight
        self.device = resolve_device(device)
        self.memory = memory  # bytes the decoded updates may take at a time
        self.seed = seed  # each round's draw of contributors derives from it; None: unpredictable

    def wait_for_nodes(self, grid: Grid) -> list[int]:
        deadline = time.monotonic() + self.wait_for_clients_s
        while not self.stop.is_set():
            nodes = list(grid.get_node_ids())
            if len(nodes) >= self.min_available_nodes:
                return nodes
            if time.monotonic() > deadline:
                break
            self.stop.wait(0.5)
        return []

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        nodes = self.wait_for_nodes(grid)
        if not nodes:
            return []
        if 0 < self.clients_per_round < len(nodes):
            nodes = self.sample(nodes, self.clients_per_round, server_round)
        content = RecordDict({TASK_CONFIG: config})
        return [
            Message(content, dst_node_id=node, message_type=MessageType.TRAIN)
            for node in sorted(nodes)
        ]

    def sample(self, nodes: list[int], k: int, server_round: int) -> list[int]:
        """k of `nodes`: uniformly, or by reputation when `selection_floor` > 0 (weights
        max(r, floor) / sum, see `zoo_gym.scoring.selection_weights`). With a `seed` the draw
        is a function of it, the round, the nodes (taken in id order) and their reputations,
        so a simulation repeats its rounds' samples; without one it comes from the operating
        system's randomness, so no contributor can tell in advance who a round picks."""
        nodes = sorted(nodes)
        seed = (
            secrets.randbits(63) if self.seed is None else selection_seed(self.seed, server_round)
        )
        generator = torch.Generator().manual_seed(seed)
        if self.selection_floor <= 0:
            picked = torch.randperm(len(nodes), generator=generator)[:k]
            return [nodes[int(i)] for i in picked]
        with Session(self.backend.engine) as session:
            known = {node_id(c.public_key): c.reputation for c in ledger.list_contributors(session)}
        reputations = {str(n): known.get(n, 0.0) for n in nodes}
        drawn = sample_contributors(reputations, k, floor=self.selection_floor, generator=generator)
        return [int(n) for n in drawn]

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Flower's interface to `aggregate_round`: the update as an ArrayRecord (None when the
        round produced none) and counts."""
        agg = self.aggregate_round(server_round, replies)
        if not agg.update:
            return None, None
        metrics = MetricRecord({"accepted": agg.accepted, "aggregated": len(agg.row_contributors)})
        return ArrayRecord(torch_state_dict=agg.update), metrics

    def aggregate_round(self, server_round: int, replies: Iterable[Message]) -> RoundAggregate:
        """Aggregate the accepted replies with the round's rule and record each decision; the
        result has an empty `update` when too few updates were usable."""
        replies = [r for r in replies if not r.has_error()]
        accepted = [r for r in replies if _intake(r).accepted]
        nothing = RoundAggregate({}, (), len(replies), len(accepted))
        if len(accepted) < self.quorum:
            log.warning(
                "round %d: %d accepted updates, quorum is %d",
                server_round,
                len(accepted),
                self.quorum,
            )
            return nothing
        layout = self.layout()
        if self.rule == "fedavg" and self.pre is None and not self.keep_rows:
            with phase("decode+aggregate", f"round {server_round}, fused fedavg"):
                fused = self._fused_fedavg(accepted, layout, received=len(replies))
            if fused is not None:
                log.info(
                    "round %d: %d updates averaged in one fused pass", server_round, len(accepted)
                )
                return fused
        in_memory = self._decodes_in_memory(accepted, layout)
        how = "decoded in memory" if in_memory else "payload columns"
        with phase("decode", f"round {server_round}, {len(accepted)} updates, {how}"):
            decode = self._decoded_in_memory if in_memory else self._payload_columns
            updates, rows = decode(accepted, layout)
        needed = max(self.quorum, min_clients(self.rule, self.f))
        if len(rows) < needed:
            log.warning(
                "round %d: %d decodable updates, %s with f=%d needs %d",
                server_round,
                len(rows),
                self.rule,
                self.f,
                needed,
            )
            reason = f"round aborted: {len(rows)} usable updates, {self.rule} needs {needed}"
            self._record(
                ledger.AggregationDecision(_intake(r).submission_id, False, 0.0, 0.0, None, reason)
                for r in rows
            )
            return nothing
        with phase("aggregate", f"round {server_round}, {self.rule}"):
            return self._robust(
                updates, rows, layout, received=len(replies), accepted=len(accepted)
            )

    def _decodes_in_memory(self, accepted: list[Message], layout: Layout) -> bool:
        """Whether the rule reads the accepted updates decoded into one `(n, d)` buffer (else
        column chunks of their compressed payloads): where three decoded copies fit in
        `memory`, unless the rule would read them from their sign bits instead (every payload
        BitDelta with float16 scales, on the CPU where the Triton kernels do not decode, no
        pre-aggregation: `reads_sign_bits`)."""
        d = numel(layout)
        if 3 * len(accepted) * d * 4 > self.memory:
            return False
        cpu = self.device.type == "cpu" and not kernels.active_for(self.device)
        if not cpu or self.pre is not None or not reads_sign_bits(len(accepted)):
            return True
        # the first payload that checks speaks for the round: intake holds every payload to
        # the round's codec (a round of mixed payloads still aggregates from their columns,
        # the rule decoding them); the payload path checks every one
        for reply in accepted:
            data = self.backend.payload_path(_intake(reply).payload_sha256).read_bytes()
            try:
                header = PayloadColumns.check(data, layout, d)
            except EnvelopeError:
                continue  # the payload path refuses it, with the reason
            return not PayloadColumns.offers_sign_groups([header])
        return True

    def _payload_columns(
        self, accepted: list[Message], layout: Layout
    ) -> tuple[Columns, list[Message]]:
        """A column source over the accepted payloads (compressed, in memory) that decode
        within `memory` per chunk; each payload is checked on its own first (envelope, layout,
        scales; the values themselves for the raw codecs), once."""
        d = numel(layout)
        payloads: list[bytes] = []
        headers: list[EnvelopeHeader] = []
        rows: list[Message] = []
        for reply in accepted:
            intake = _intake(reply)
            data = self.backend.payload_path(intake.payload_sha256).read_bytes()
            try:
                header = PayloadColumns.check(data, layout, d)
                raw = any(section.codec in RAW_CODECS for section in header.sections)
                finite = not raw or _all_finite(
                    PayloadColumns(
                        [data], layout, max_elements=d, budget=self.memory, headers=[header]
                    ),
                    self.memory,
                )
            except EnvelopeError as exc:
                self._decide(intake, selected=False, reason=f"could not be decoded: {exc}")
                continue
            if not finite:
                self._decide(intake, selected=False, reason="update contains NaN or Inf values")
                continue
            payloads.append(data)
            headers.append(header)
            rows.append(reply)
        source = PayloadColumns(
            payloads,
            layout,
            max_elements=d,
            budget=self.memory,
            device=self.device,
            headers=headers,
        )
        return source, rows

    def _decoded_in_memory(
        self, accepted: list[Message], layout: Layout
    ) -> tuple[torch.Tensor, list[Message]]:
        """The accepted updates decoded into one `(n, d)` float32 buffer, row by row straight
        from the envelopes, and the replies of the rows."""
        updates = torch.empty(
            (len(accepted), numel(layout)), dtype=torch.float32, device=self.device
        )
        rows: list[Message] = []
        for reply in accepted:
            intake = _intake(reply)
            data = self.backend.payload_path(intake.payload_sha256).read_bytes()
            try:
                decode_into(data, updates[len(rows)], layout, max_elements=numel(layout))
            except EnvelopeError as exc:
                self._decide(intake, selected=False, reason=f"could not be decoded: {exc}")
                continue
            if not torch.isfinite(updates[len(rows)]).all():
                self._decide(intake, selected=False, reason="update contains NaN or Inf values")
                continue
            rows.append(reply)
        return updates[: len(rows)], rows

    def _robust(
        self,
        updates: torch.Tensor | Columns,
        rows: list[Message],
        layout: Layout,
        *,
        received: int,
        accepted: int,
    ) -> RoundAggregate:
        """The round's rule over the decoded `updates` (weighted rules by the examples each
        trained on, ramped by trust), its decision about each row recorded."""
        weights = None
        if self.rule in WEIGHTED_RULES:
            weights = torch.tensor(
                self._influence(rows), dtype=torch.float64, device=updates.device
            )
        result: Aggregate = aggregate(
            self.rule, updates, f=self.f, weights=weights, pre=self.pre, **self.params
        )
        self._record_decisions(rows, result.decisions)
        contributors = [
            _intake(reply).contributor_id
            for reply, decision in zip(rows, result.decisions, strict=True)
            if decision.selected or decision.weight > 0
        ]
        return RoundAggregate(
            {k: v.clone() for k, v in unflatten(result.vector.float().cpu(), layout).items()},
            tuple(contributors),
            received=received,
            accepted=accepted,
            rows=updates.cpu() if isinstance(updates, torch.Tensor) else updates,
            row_contributors=_senders(rows),
            decisions=result.decisions,
        )

    def _fused_fedavg(
        self, accepted: list[Message], layout: Layout, *, received: int
    ) -> RoundAggregate | None:
        """FedAvg without one decoded row per update: every envelope is decoded and added in
        place into one `(d,)` float32 sum (`decode_accumulate`, fused for BitDelta).

        Returns None, having recorded nothing, when an envelope fails to decode or the sum is not
        finite: the row-by-row path then finds and records the culprit.
        """
        if any(_examples(r) < 0 for r in accepted):  # the row path refuses these and says why
            return None
        examples = self._influence(accepted)
        needed = max(self.quorum, min_clients(self.rule, self.f))
        total = sum(examples)
        if len(accepted) < needed or total <= 0:
            return None
        weights = [e / total for e in examples]
        summed = torch.zeros(numel(layout), dtype=torch.float32, device=self.device)
        for reply, w in zip(accepted, weights, strict=True):  # one payload in memory at a time
            data = self.backend.payload_path(_intake(reply).payload_sha256).read_bytes()
            try:
                decode_accumulate([data], [w], summed, layout, max_elements=numel(layout))
            except EnvelopeError:
                return None
        if not torch.isfinite(summed).all():
            return None
        decisions = fedavg_decisions(weights)
        self._record_decisions(accepted, decisions)
        contributors = [
            _intake(reply).contributor_id
            for reply, decision in zip(accepted, decisions, strict=True)
            if decision.selected
        ]
        return RoundAggregate(
            {k: v.clone() for k, v in unflatten(summed.cpu(), layout).items()},
            tuple(contributors),
            received=received,
            accepted=len(accepted),
            row_contributors=_senders(accepted),
            decisions=decisions,
        )

    def _influence(self, replies: list[Message]) -> list[float]:
        """Weights of the replies in a weighted rule: claimed examples ramped by the senders'
        trust (`zoo_gym.scoring.influence_weights`; a fresh identity weighs `fresh_weight`)."""
        examples = [_examples(r) for r in replies]
        if self.trusted_reputation <= 0 or any(e < 0 or not math.isfinite(e) for e in examples):
            return examples
        with Session(self.backend.engine) as session:
            known = {c.contributor_id: c.reputation for c in ledger.list_contributors(session)}
        reputations = [
            min(1.0, max(0.0, known.get(contributor, 0.0))) for contributor in _senders(replies)
        ]
        return influence_weights(
            examples, reputations, trusted_at=self.trusted_reputation, floor=self.fresh_weight
        )

    def _decide(self, intake: IntakeResult, *, selected: bool, reason: str) -> None:
        """Record that the submission of `intake` was left out of the aggregate, and why."""
        self._record(
            [ledger.AggregationDecision(intake.submission_id, selected, 0.0, 0.0, None, reason)]
        )

    def _record_decisions(self, rows: list[Message], decisions: Sequence[Decision]) -> None:
        """Record the rule's decision about each row, all in one ledger transaction."""
        self._record(
            ledger.AggregationDecision(
                _intake(reply).submission_id,
                d.selected,
                d.weight,
                d.trimmed_share,
                d.score,
                d.reason,
            )
            for reply, d in zip(rows, decisions, strict=True)
        )

    def _record(self, decisions: Iterable[ledger.AggregationDecision]) -> None:
        with Session(self.backend.engine) as session:
            ledger.record_aggregations(session, decisions=list(decisions))


def resolve_device(name: str) -> torch.device:
    """The device `name` names on this machine: "auto" is the first CUDA device when PyTorch
    sees one, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f'device = "{name}", but PyTorch sees no CUDA device here; use "auto"')
    return device


def _all_finite(source: Columns, budget: int) -> bool:
    """Whether every value of a one-row source is finite, read in chunks of `budget` bytes."""
    width = max(1, budget // 4)
    return all(
        bool(torch.isfinite(source.columns(start, min(start + width, source.d))).all())
        for start in range(0, source.d, width)
    )


def _intake(reply: Message) -> IntakeResult:
    """What intake decided about the submission `reply` answers."""
    return IntakeResult.from_record(reply.content.config_records[SUBMISSION])


def _senders(replies: list[Message]) -> tuple[str, ...]:
    return tuple(_intake(r).contributor_id for r in replies)


def _examples(reply: Message) -> float:
    """How many examples a reply says it trained on (its FedAvg weight; 1 when unsaid)."""
    metrics = reply.content.metric_records.get(TRAIN_METRICS, MetricRecord())
    return _number(metrics.get("num_examples", 1.0))


def _number(value: object) -> float:
    """A scalar metric as float (1.0 when a contributor sent something else)."""
    return float(value) if isinstance(value, int | float) else 1.0
