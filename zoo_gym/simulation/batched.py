"""A federation of many virtual contributors that train together on one shared base model.

The coordinator's side is the in-process federation's: the ServerApp round loop, the
`SimulationGrid` (adversary, intake), the ledger, aggregation, merge and publish. What
changes is who answers the round's train messages. Instead of one ClientApp (and one
model, one copy of every version on disk) per contributor, `BatchedClients` answers all
of them: the published version is loaded once into `BatchedFfaLora`, the contributors
train in groups of `group` with their Bs stacked (`zoo_gym.simulation.batched_training`),
and each contributor's update then takes the path of `ClientRuntime.train`: privacy plan,
clip (and update noise), a data attacker's `corrupt`, error-feedback compression with the
contributor's own residual (kept in memory), metrics, signature.

Only FFA-LoRA SFT without DP-SGD runs batched (DP-SGD samples and clips per record and
draws secret noise; GRPO generates): other tasks get one line naming the inprocess engine.
"""

from __future__ import annotations

import logging
import queue
import shutil
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from flwr.app import Message
from transformers import AutoTokenizer

from zoo_gym.client.byzantine import Misbehaviour
from zoo_gym.client.feedback import FfaErrorFeedback
from zoo_gym.client.privacy import PrivacyAccount, PrivacyPlan, plan_round
from zoo_gym.client.runtime import (
    ModelSource,
    compress_for_task,
    privatize,
    signed_reply,
    train_metrics,
)
from zoo_gym.client.trainers.adapters import DEFAULT_MAX_FULL_PARAMS, load_base_model
from zoo_gym.client.trainers.sft import RoundResult
from zoo_gym.coordinator.config import CoordinatorConfig, load_config
from zoo_gym.coordinator.rounds import RoundSummary, lora_spec
from zoo_gym.coordinator.service import Coordinator
from zoo_gym.core.chat import Conversation, encode_conversation, pad_id_of, to_conversation
from zoo_gym.core.identity import Identity
from zoo_gym.core.lora import LoraSpec
from zoo_gym.core.protocol import TASK_CONFIG, TaskConfig
from zoo_gym.core.weights import load_weights
from zoo_gym.simulation.adversary import Adversary
from zoo_gym.simulation.batched_training import (
    BatchedEngineError,
    BatchedFfaLora,
    GroupResult,
    Records,
)
from zoo_gym.simulation.grid import IntakeGrid
from zoo_gym.simulation.inprocess import (
    colluders,
    enrol,
    registry_source,
    run_rounds,
)
from zoo_gym.simulation.sweep import ATTACK_NAMES
from zoo_gym.transport.backend import FederationBackend
from zoo_gym.transport.loopback import submit_to_intake

log = logging.getLogger(__name__)
DEFAULT_GROUP = 50
"""Contributors per forward pass of a training thread (with two threads a round of 1,000 on the
tiny model peaks near 1 GB of RSS, bench/README.md)."""
DEFAULT_WORKERS = 2
"""Training threads, each with its own copy of the model and one intra-op thread."""


@dataclass
class VirtualContributor:
    """What a contributor keeps between rounds: its key, records, residual and privacy account."""

    identity: Identity
    conversations: list[Conversation]
    misbehaviour: Misbehaviour | None = None
    feedback: FfaErrorFeedback = field(default_factory=FfaErrorFeedback)
    account: PrivacyAccount = field(default_factory=PrivacyAccount)
    encoded: dict[int, Records] = field(default_factory=dict)  # max_length -> its records


def enlist(
    co: Coordinator,
    shards: list[list[dict[str, str]]],
    byzantine: Collection[int],
    attack: str,
    params: dict[str, float],
    *,
    seed: int,
) -> tuple[dict[int, VirtualContributor], dict[int, Identity], dict[int, str]]:
    """Register a key per shard: (node -> contributor that trains, node -> key of an attacker
    whose update the adversary crafts, node -> contributor id of every attacker)."""
    contributors: dict[int, VirtualContributor] = {}
    roll = enrol(co, len(shards), byzantine, attack, seed)
    for i, node, identity, attacker in roll.trainers:
        misbehaviour = None
        conversations = [to_conversation(r) for r in shards[i]]
        if attacker:
            misbehaviour = Misbehaviour(attack, params, seed=seed + i)
            conversations = misbehaviour.poison(conversations)
        contributors[node] = VirtualContributor(identity, conversations, misbehaviour)
    return contributors, roll.crafted, roll.bad


def plan_rounds(task: TaskConfig, contributors: list[VirtualContributor]) -> list[PrivacyPlan]:
    """Each contributor's `plan_round` for `task`, computed once per distinct input: a plan
    depends only on the task, the number of records and the account's mechanism histories."""
    plans: dict[tuple[Any, ...], PrivacyPlan] = {}
    out = []
    for c in contributors:
        a = c.account
        key = (
            len(c.conversations),
            tuple(a.sample_history),
            tuple(a.user_history),
            a.sample_unbounded,
            a.user_unbounded,
        )
        if key not in plans:
            plans[key] = plan_round(task, num_records=len(c.conversations), account=a)
        out.append(plans[key])
    return out


def check_task(task: TaskConfig) -> None:
    """Refuse, in one line, a task the batched engine does not train as a real client would."""
    problems = []
    if task.method != "sft":
        problems.append(f"method {task.method}")
    if task.adapter != "ffa_lora":
        problems.append(f"adapter {task.adapter}")
    if task.dp_noise_multiplier > 0 or task.dp_target_epsilon > 0:
        problems.append("DP-SGD")
    if problems:
        raise BatchedEngineError(
            f"round {task.round} asks for {', '.join(problems)}; the batched engine trains "
            "FFA-LoRA SFT without DP-SGD only: run this sweep with --engine inprocess"
        )


class BatchedClients:
    """The virtual contributors that train: one train message each, answered together."""

    def __init__(
        self,
        contributors: Mapping[int, VirtualContributor],
        *,
        model_source: ModelSource,
        workdir: Path,
        group: int = DEFAULT_GROUP,
        workers: int = DEFAULT_WORKERS,
    ) -> None:
        self.contributors = dict(contributors)
        self.model_source = model_source
        self.workdir = workdir
        self.group = group
        self.workers = workers
        self.trainers: list[BatchedFfaLora] = []  # one model per training thread
        self.tokenizer: Any = None
        self.base_version = ""
        self._encodings: dict[tuple[int, str], tuple[list[int], list[int]]] = {}

    def stream(self, messages: list[Message]) -> Iterator[Message]:
        """The signed reply to each train message, in order, as soon as its group is trained:
        `workers` threads train groups side by side (each on its own copy of the model, one
        intra-op thread each) and then compress and sign their group's updates, while the
        caller takes the replies of the groups done."""
        if not messages:
            return
        task = TaskConfig.from_record(messages[0].content.config_records[TASK_CONFIG])
        for m in messages[1:]:
            if TaskConfig.from_record(m.content.config_records[TASK_CONFIG]) != task:
                raise ValueError("the batched engine trains one task per round")
        check_task(task)
        spec = LoraSpec(
            rank=task.lora_rank, alpha=task.lora_alpha, target_modules=task.target_modules
        )
        self.ensure_base(task.base_version, spec)
        nodes = [self.contributors[m.metadata.dst_node_id] for m in messages]
        plans = plan_rounds(task, nodes)  # before training, as a client plans (and may refuse)
        records = [self.records(c, task.max_length) for c in nodes]
        free: queue.SimpleQueue[BatchedFfaLora] = queue.SimpleQueue()
        for trainer in self.trainers:
            free.put(trainer)

        def train(chunk: range) -> list[Message]:
            trainer = free.get()
            began = time.perf_counter()
            try:
                results = trainer.train_group(
                    [records[i] for i in chunk],
                    seed=task.seed,
                    a_seed=task.a_seed,
                    steps=task.steps,
                    lr=task.learning_rate,
                    batch_size=task.batch_size,
                )
            finally:
                free.put(trainer)
            seconds = (time.perf_counter() - began) / len(chunk)
            return [
                self._finish(nodes[i], messages[i], task, spec, plans[i], result, seconds)
                for i, result in zip(chunk, results, strict=True)
            ]

        size = self.group
        chunks = [range(i, min(i + size, len(nodes))) for i in range(0, len(nodes), size)]
        with ThreadPoolExecutor(max_workers=len(self.trainers)) as pool:
            futures = [pool.submit(train, chunk) for chunk in chunks]
            for chunk, future in zip(chunks, futures, strict=True):
                yield from future.result()
                log.info(
                    "round %d: %d of %d contributors trained", task.round, chunk.stop, len(nodes)
                )

    def ensure_base(self, version: str, spec: LoraSpec) -> None:
        """Every training thread's model holding `version` (built on the first round), from
        the one copy of it kept on disk."""
        if self.trainers and self.trainers[0].spec == spec and self.base_version == version:
            return
        directory = self.workdir / "models" / version
        self.model_source(version, directory)
        if not self.trainers or self.trainers[0].spec != spec:
            self.trainers = []  # drop the old models before loading new ones
            self.tokenizer = AutoTokenizer.from_pretrained(directory)
            for _ in range(self.workers):
                model = load_base_model(
                    directory,
                    adapter="ffa_lora",
                    device="cpu",
                    max_full_params=DEFAULT_MAX_FULL_PARAMS,
                )
                self.trainers.append(
                    BatchedFfaLora(model, spec=spec, pad_id=pad_id_of(self.tokenizer))
                )
        else:
            state = load_weights(directory)
            for trainer in self.trainers:
                trainer.load_base(state)
        self.base_version = version
        for old in directory.parent.iterdir():  # one copy on disk: the version in memory
            if old != directory:
                shutil.rmtree(old, ignore_errors=True)

    def prepare(self, version: str, spec: LoraSpec, max_length: int) -> None:
        """Load `version` and tokenise every contributor's records for `max_length` ahead of
        the first round (what each contributor's `join` does once before it trains)."""
        self.ensure_base(version, spec)
        for contributor in self.contributors.values():
            self.records(contributor, max_length)

    def records(self, contributor: VirtualContributor, max_length: int) -> Records:
        """The contributor's records tokenised as `encode_conversation` does (each distinct
        conversation once: many contributors share records of the synthetic task)."""
        found = contributor.encoded.get(max_length)
        if found is None:
            found = Records.of(
                [self._encode(c, max_length) for c in contributor.conversations],
                pad_id_of(self.tokenizer),
            )
            contributor.encoded = {max_length: found}
        return found

    def _encode(self, conversation: Conversation, max_length: int) -> tuple[list[int], list[int]]:
        key = (max_length, repr(conversation))
        found = self._encodings.get(key)
        if found is None:
            found = encode_conversation(self.tokenizer, conversation, max_length=max_length)
            self._encodings[key] = found
        return found

    def _finish(
        self,
        contributor: VirtualContributor,
        message: Message,
        task: TaskConfig,
        spec: LoraSpec,
        plan: PrivacyPlan,
        result: GroupResult,
        seconds: float,
    ) -> Message:
        """`ClientRuntime.train` after training: clip, noise, corrupt, compress, sign."""
        update, norm = privatize(
            result.update, clip_norm=task.clip_norm, noise_std=plan.update_noise_std
        )
        contributor.account.commit(plan)
        if contributor.misbehaviour is not None:
            update = contributor.misbehaviour.corrupt(update, task.round)
        in_features = {module: shape[1] for module, shape in self.trainers[0].shapes.items()}
        honest = contributor.misbehaviour is None
        payload = compress_for_task(
            contributor.feedback, update, task, spec, in_features, honest=honest
        )
        raw_bytes = sum(t.numel() * 2 for t in update.values())  # as bf16
        round_result = RoundResult(
            update=update,
            num_examples=result.num_examples,
            mean_loss=result.mean_loss,
            tokens=result.tokens,
            seconds=seconds,
        )
        metrics = train_metrics(
            round_result, update_norm=norm, raw_bytes=raw_bytes, payload_bytes=len(payload)
        )
        return signed_reply(
            contributor.identity, message, task, payload, {**metrics, **plan.metrics()}
        )


class BatchedGrid(IntakeGrid):
    """`IntakeGrid` over `BatchedClients`: each reply goes to intake as soon as its group
    is trained and every reply before it in the batch is in, so intake runs beside training.
    Replies reach intake in the batch's order, as through `SimulationGrid`."""

    def __init__(
        self,
        clients: BatchedClients,
        backend: FederationBackend,
        *,
        spool: Path,
        adversary: Adversary | None = None,
    ) -> None:
        routes = {n: n for n in clients.contributors}
        super().__init__(backend, routes=routes, spool=spool, adversary=adversary)
        self.clients = clients

    def _answer(self, batch: list[Message], timeout: float | None) -> list[Message | None]:
        byzantine = self.adversary.identities if self.adversary else {}
        honest = [m for m in batch if m.metadata.dst_node_id not in byzantine]
        attacked = [m for m in batch if m.metadata.dst_node_id in byzantine]
        replies = self.clients.stream(honest)
        raw: dict[int, Message] = {}
        crafted: dict[int, Message] = {}
        out: list[Message | None] = []
        for m in batch:
            if m.metadata.dst_node_id in byzantine:
                if not crafted:
                    for h, reply in zip(honest[len(raw) :], replies, strict=True):
                        raw[id(h)] = reply
                    assert self.adversary is not None
                    made = self.adversary.replies([raw[id(h)] for h in honest], attacked)
                    crafted = {id(a): r for a, r in zip(attacked, made, strict=True)}
                reply = crafted[id(m)]
            else:
                reply = raw[id(m)] if id(m) in raw else next(replies)
                raw[id(m)] = reply
            out.append(submit_to_intake(self.backend, self.spool, m.metadata.dst_node_id, reply, m))
        return out


@dataclass
class BatchedFederation:
    """The coordinator's round loop over `BatchedClients` (and an adversary's crafted nodes)."""

    coordinator: Coordinator
    clients: BatchedClients
    grid: BatchedGrid
    byzantine: dict[int, str] = field(default_factory=dict)  # node id -> contributor id
    summaries: list[RoundSummary] = field(default_factory=list)

    @classmethod
    def build(
        cls,
        home: Path,
        shards: list[list[dict[str, str]]],
        *,
        overrides: dict[str, Any] | None = None,
        byzantine: Collection[int] = (),
        attack: str = "none",
        attack_params: Mapping[str, float] | None = None,
        seed: int = 0,
        group: int = DEFAULT_GROUP,
        workers: int = DEFAULT_WORKERS,
    ) -> BatchedFederation:
        """Shard i trains as contributor i; those whose index is in `byzantine` run `attack`
        (as in `InProcessFederation.build`)."""
        if attack not in ATTACK_NAMES:
            raise ValueError(f"unknown attack {attack!r}; choose one of {', '.join(ATTACK_NAMES)}")
        config = load_config(home / "coordinator.toml")
        config = CoordinatorConfig.model_validate(
            {**config.model_dump(), "selection_seed": seed, **(overrides or {})}
        )
        co = Coordinator(config)
        contributors, crafted, bad = enlist(
            co, shards, byzantine, attack, dict(attack_params or {}), seed=seed
        )
        adversary = colluders(attack, crafted, config.byzantine_f, seed, attack_params)
        clients = BatchedClients(
            contributors,
            model_source=registry_source(co),
            workdir=home / "batched",
            group=group,
            workers=workers,
        )
        clients.prepare(
            co.registry.latest().version, lora_spec(config.training), config.training.max_length
        )
        grid = BatchedGrid(clients, co.backend, spool=home / "spool", adversary=adversary)
        return cls(co, clients, grid, bad)

    def run(self, on_round: Callable[[RoundSummary], None] | None = None) -> list[RoundSummary]:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # parallel across training threads, not within an op
        try:
            return run_rounds(self.coordinator, self.grid, self.summaries, on_round)
        finally:
            torch.set_num_threads(threads)
