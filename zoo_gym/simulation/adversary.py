"""Omniscient Byzantine contributors for simulations.

The update attacks of `zoo_gym.attacks` assume the threat model of their
papers: the attackers collude and see every honest update of the round before they
answer. `Adversary` plays that role. It decodes the honest replies exactly as the
coordinator will, computes the malicious rows with the configured attack, encodes them
with the round's codec and signs them with the Byzantine contributors' registered keys,
so the coordinator's intake, aggregation and ledger treat them like any other upload.
"""

from __future__ import annotations

import hashlib
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from flwr.app import Message, MetricRecord

from zoo_gym.attacks import ATTACKS
from zoo_gym.client.runtime import signed_reply
from zoo_gym.compression import CodecSpec, decode, encode
from zoo_gym.core.delta import Layout, flatten, layout_of, numel, unflatten
from zoo_gym.core.identity import Identity
from zoo_gym.core.protocol import (
    SUBMISSION,
    TASK_CONFIG,
    TRAIN_METRICS,
    TaskConfig,
    payload_of,
)

UPDATE_ATTACKS = tuple(name for name in ATTACKS if name != "none")


@dataclass
class Adversary:
    """Crafts the replies of the Byzantine nodes in `identities` from the honest ones."""

    attack: str
    identities: Mapping[int, Identity]  # Byzantine node id -> its registered key
    f: int
    seed: int = 0
    params: Mapping[str, float] = field(default_factory=dict)
    max_elements: int = 1 << 31

    def __post_init__(self) -> None:
        if self.attack not in ATTACKS:
            raise ValueError(
                f"unknown update attack {self.attack!r}; choose one of {', '.join(ATTACKS)}"
            )

    def replies(self, honest: Sequence[Message], requests: Sequence[Message]) -> list[Message]:
        """One signed reply per request in `requests` (each addressed to a Byzantine node)."""
        if not requests:
            return []
        usable = [r for r in honest if not r.has_error()]
        if not usable:
            raise RuntimeError(
                "the adversary needs at least one honest update to attack; lower the Byzantine share"
            )
        task = TaskConfig.from_record(requests[0].content.config_records[TASK_CONFIG])
        rows, layout = self._honest_rows(usable)  # (h, d)
        generator = torch.Generator().manual_seed(self._round_seed(task.round))
        crafted = ATTACKS[self.attack](
            rows, num_byzantine=len(requests), f=self.f, generator=generator, **self.params
        )  # (b, d)
        spec = CodecSpec(codec=task.codec, group_size=task.group_size, granularity=task.granularity)
        examples = statistics.fmean(_num_examples(r) for r in usable)
        out = []
        for request, row in zip(requests, crafted, strict=True):
            identity = self.identities[request.metadata.dst_node_id]
            payload = encode(unflatten(row.to(torch.float32), layout), spec)
            metrics: dict[str, int | float | list[int] | list[float]] = {"num_examples": examples}
            out.append(signed_reply(identity, request, task, payload, metrics))
        return out

    def _honest_rows(self, replies: Sequence[Message]) -> tuple[torch.Tensor, Layout]:
        deltas = [decode(_payload(r), max_elements=self.max_elements) for r in replies]
        layout = layout_of(deltas[0])
        rows = torch.empty((len(deltas), numel(layout)), dtype=torch.float32)
        for i, delta in enumerate(deltas):
            flatten(delta, layout, out=rows[i])
        return rows, layout

    def _round_seed(self, round_number: int) -> int:
        digest = hashlib.sha256(
            f"zoo-gym/adversary|{self.seed}|{self.attack}|{round_number}".encode()
        ).digest()
        return int.from_bytes(digest[:8], "big") >> 1


def _payload(reply: Message) -> bytes:
    return payload_of(reply.content.config_records[SUBMISSION])


def _num_examples(reply: Message) -> float:
    value = reply.content.metric_records.get(TRAIN_METRICS, MetricRecord()).get("num_examples", 1.0)
    return float(value) if isinstance(value, int | float) else 1.0
