"""A contributor's long-lived runtime: one model in memory across rounds.

`ClientRuntime.train` is the body of the Flower ClientApp's train function:
from a round task to a signed, compressed submission. Order (DESIGN.md,
"Privacy"): train -> clip the update -> compress with error feedback -> sign.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from zoo_gym.client.byzantine import Misbehaviour
from zoo_gym.client.feedback import FfaErrorFeedback
from zoo_gym.client.state import LocalState
from zoo_gym.client.trainers.sft import FfaLoraTrainer, StepInfo
from zoo_gym.compression import CodecSpec
from zoo_gym.core.chat import Conversation
from zoo_gym.core.identity import Identity
from zoo_gym.core.lora import LoraSpec
from zoo_gym.core.protocol import (
    PAYLOAD,
    SUBMISSION,
    TASK_CONFIG,
    TRAIN_METRICS,
    Submission,
    TaskConfig,
)
from zoo_gym.privacy.clip import clip_delta

log = logging.getLogger(__name__)

# (version, directory) -> fills `directory` with that verified version
ModelSource = Callable[[str, Path], None]


@dataclass(frozen=True)
class RoundEvent:
    """Progress a front end may show: kind is "base", "step" or "compressed"."""

    kind: str
    round: int
    detail: dict[str, float | str]


class ClientRuntime:
    def __init__(
        self,
        *,
        identity: Identity,
        conversations: list[Conversation],
        home: Path,
        model_source: ModelSource,
        device: str = "cpu",
        on_event: Callable[[RoundEvent], None] | None = None,
        misbehaviour: Misbehaviour | None = None,
    ) -> None:
        self.identity = identity
        self.misbehaviour = misbehaviour
        self.conversations = misbehaviour.poison(conversations) if misbehaviour else conversations
        self.home = home
        self.model_source = model_source
        self.device = device
        self.on_event = on_event or (lambda event: None)
        home.mkdir(parents=True, exist_ok=True)
        self.state = LocalState.load(home / "state.json")
        self.feedback = FfaErrorFeedback.load(home / "feedback.safetensors")
        self.trainer: FfaLoraTrainer | None = None
        self.base_version = ""

    def ensure_base(self, version: str, spec: LoraSpec) -> None:
        """Have `version` loaded (downloaded and verified once, then kept in memory)."""
        if self.trainer is not None and self.base_version == version and self.trainer.spec == spec:
            return
        directory = self.home / "models" / version
        self.model_source(version, directory)
        if self.trainer is None or self.trainer.spec != spec:
            model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(directory)
            self.trainer = FfaLoraTrainer(model, tokenizer, spec=spec, device=self.device)
        else:
            self.trainer.load_base(load_file(directory / "model.safetensors"))
        self.base_version = version
        self.on_event(RoundEvent("base", 0, {"version": version}))

    def train(self, message: Message) -> Message:
        task = TaskConfig.from_record(message.content.config_records[TASK_CONFIG])
        spec = LoraSpec(rank=task.lora_rank, alpha=task.lora_alpha, target_modules=task.target_modules)
        self.ensure_base(task.base_version, spec)
        assert self.trainer is not None

        def step(info: StepInfo) -> None:
            self.on_event(RoundEvent("step", task.round, {
                "step": info.step, "steps": info.steps, "loss": info.loss, "tokens_per_s": info.tokens_per_s,
            }))

        result = self.trainer.train_round(
            self.conversations, seed=task.seed, steps=task.steps, lr=task.learning_rate,
            batch_size=task.batch_size, max_length=task.max_length, on_step=step,
        )
        update = result.update
        norm = 0.0
        if task.clip_norm > 0:
            update, norm = clip_delta(update, task.clip_norm)
        if self.misbehaviour is not None:  # after clipping: an attacker ignores the protocol
            update = self.misbehaviour.corrupt(update, task.round)
        codec = CodecSpec(codec=task.codec, group_size=task.group_size)
        in_features = {module: shape[1] for module, shape in self.trainer.shapes.items()}
        payload, _ = self.feedback.compress(update, codec, lora=spec, seed=task.seed, in_features=in_features)
        self.feedback.save(self.home / "feedback.safetensors")
        raw_bytes = sum(t.numel() * 2 for t in update.values())  # as bf16
        self.on_event(RoundEvent("compressed", task.round, {"raw_bytes": raw_bytes, "payload_bytes": len(payload)}))
        return signed_reply(self.identity, message, task, payload, {
            "num_examples": float(result.num_examples), "train_loss": result.mean_loss,
            "tokens": float(result.tokens), "train_seconds": result.seconds,
            "update_norm": norm, "raw_bytes": float(raw_bytes), "payload_bytes": float(len(payload)),
        })


def signed_reply(
    identity: Identity, message: Message, task: TaskConfig, payload: bytes,
    metrics: dict[str, int | float | list[int] | list[float]],
) -> Message:
    """Sign `payload` as `identity`'s update for `task` and wrap it as the reply to `message`."""
    submission = Submission(
        contributor_id=identity.contributor_id, round=task.round,
        base_version=task.base_version, message_id=message.metadata.message_id,
        nonce=os.urandom(16), payload_sha256=hashlib.sha256(payload).hexdigest(),
        payload_size=len(payload),
    )
    record = ConfigRecord({
        "contributor_id": submission.contributor_id, "round": submission.round,
        "base_version": submission.base_version, "message_id": submission.message_id,
        "nonce": submission.nonce, "payload_sha256": submission.payload_sha256,
        "payload_size": submission.payload_size,
        "signature": identity.sign(submission.statement()), PAYLOAD: payload,
    })
    content = RecordDict({SUBMISSION: record, TRAIN_METRICS: MetricRecord(metrics)})
    return Message(content, reply_to=message)
