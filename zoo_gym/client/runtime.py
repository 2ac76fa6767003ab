"""A contributor's long-lived runtime: one model in memory across rounds.

`ClientRuntime.train` is the body of the Flower ClientApp's train function:
from a round task to a signed, compressed submission. Order (DESIGN.md,
"Privacy"): train -> clip the update -> compress with error feedback -> sign.
The privacy plan (sigma, epsilon, budget; `zoo_gym.client.privacy`) is made
before training, and update noise goes on between clipping and compression.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict
from transformers import AutoTokenizer

from zoo_gym.client.byzantine import Misbehaviour
from zoo_gym.client.errors import RoundRefusal
from zoo_gym.client.feedback import FfaErrorFeedback
from zoo_gym.client.privacy import PrivacyBudget, PrivacyPlan, PrivacyRefusal, plan_round
from zoo_gym.client.state import LocalState
from zoo_gym.client.trainers.adapters import DEFAULT_MAX_FULL_PARAMS, make_trainer
from zoo_gym.client.trainers.sft import DpConfig, RoundResult, StepInfo, Trainer
from zoo_gym.compression import CodecSpec, carry_spec, feedback_cap
from zoo_gym.core.chat import Conversation
from zoo_gym.core.delta import Delta
from zoo_gym.core.identity import Identity
from zoo_gym.core.lora import LoraSpec
from zoo_gym.core.phases import phase
from zoo_gym.core.protocol import (
    PAYLOAD,
    POLICY_OBJECTIVES,
    SUBMISSION,
    TASK_CONFIG,
    TRAIN_METRICS,
    SignedSubmission,
    TaskConfig,
)
from zoo_gym.core.weights import load_weights
from zoo_gym.privacy.clip import clip_delta
from zoo_gym.privacy.noise import add_gaussian_noise, secure_generator

log = logging.getLogger(__name__)

# (version, directory) -> fills `directory` with that verified version
ModelSource = Callable[[str, Path], None]


@dataclass(frozen=True)
class RoundEvent:
    """Progress a front end may show: kind is "base", "privacy", "step" or "compressed"."""

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
        reward_functions: Sequence[str] = (),
        error_feedback: bool = True,
        gradient_checkpointing: bool = False,
        max_full_params: int = DEFAULT_MAX_FULL_PARAMS,
        privacy_budget: PrivacyBudget | None = None,
        method: str = "any",
    ) -> None:
        self.identity = identity
        self.privacy_budget = privacy_budget  # None: no limit
        self.method = method  # the objective this client accepts: sft, grpo, gspo or any
        self.reward_functions = tuple(reward_functions)  # the contributor's "module:function" paths
        self.gradient_checkpointing = gradient_checkpointing
        self.max_full_params = max_full_params
        self.misbehaviour = misbehaviour
        self.conversations = misbehaviour.poison(conversations) if misbehaviour else conversations
        self.home = home
        self.model_source = model_source
        self.device = device
        self.on_event = on_event or (lambda event: None)
        home.mkdir(parents=True, exist_ok=True)
        self.state = LocalState.load(home / "state.json")
        self.feedback = FfaErrorFeedback.load(home / "feedback.safetensors", enabled=error_feedback)
        # True: the residual is saved as soon as a round is compressed. A front end that uploads
        # sets False and calls commit_feedback once the coordinator holds the update (or
        # revert_feedback when it refused it), so a crash in between never carries a residual twice.
        self.persist_feedback = True
        self.trainer: Trainer | None = None
        self.adapter = ""
        self.base_version = ""

    def ensure_base(self, version: str, spec: LoraSpec, adapter: str = "ffa_lora") -> None:
        """Have `version` loaded (downloaded and verified once, then kept in memory).

        The model is built once and kept between rounds; it is rebuilt only when the
        coordinator switches the adapter or the LoRA spec.
        """
        same_kind = (
            self.trainer is not None and self.trainer.spec == spec and self.adapter == adapter
        )
        if same_kind and self.base_version == version:
            return
        directory = self.base_directory(version)
        with phase("load", version):
            if self.trainer is None or not same_kind:
                self.trainer = None  # drop the old model before loading the new one
                tokenizer = AutoTokenizer.from_pretrained(directory)
                self.trainer = make_trainer(
                    directory,
                    tokenizer,
                    adapter=adapter,
                    spec=spec,
                    device=self.device,
                    gradient_checkpointing=self.gradient_checkpointing,
                    max_full_params=self.max_full_params,
                )
                self.adapter = adapter
            else:
                self.trainer.load_base(load_weights(directory))
        self.base_version = version
        self.on_event(RoundEvent("base", 0, {"version": version}))

    def base_directory(self, version: str) -> Path:
        """The directory holding `version`, verified (downloaded when missing or failing its check)."""
        directory = self.home / "models" / version
        with phase("download", version):
            self.model_source(version, directory)
        return directory

    def based_on(self, version: str) -> None:
        """Rounds now train on `version`, which a ClientApp of the contributor's own loads from
        its directory; the front end hears of each new one."""
        if version != self.base_version:
            self.base_version = version
            self.on_event(RoundEvent("base", 0, {"version": version}))

    def task_of(self, message: Message) -> TaskConfig:
        """The round task `message` carries; refuses an objective this client does not run."""
        task = TaskConfig.from_record(message.content.config_records[TASK_CONFIG])
        if self.method not in ("any", task.method):
            raise RoundRefusal(
                f"round {task.round} asks for {task.method} training and this client runs only {self.method}; "
                f"join again with --method {task.method} or --method any"
            )
        return task

    def train(self, message: Message) -> Message:
        task = self.task_of(message)
        spec = task_spec(task)
        plan = plan_round(
            task,
            num_records=len(self.conversations),
            account=self.state.privacy,
            budget=self.privacy_budget,
        )  # refuses before anything is trained
        self.ensure_base(task.base_version, spec, task.adapter)
        assert self.trainer is not None
        dp = self._dp_config(plan, self.trainer)
        with phase("train", f"round {task.round}, {task.steps} steps"):
            result = self.run_objective(self.trainer, task, self._step_events(task.round), dp=dp)
        in_features = {module: shape[1] for module, shape in self.trainer.shapes.items()}
        return self.reply(message, task, plan, result, spec=spec, in_features=in_features)

    def reply(
        self,
        message: Message,
        task: TaskConfig,
        plan: PrivacyPlan,
        result: RoundResult,
        *,
        spec: LoraSpec,
        in_features: dict[str, int],
    ) -> Message:
        """The signed reply to `message` from a trained round: clip the update, add the plan's
        noise, account the round, compress with error feedback and sign (the path every
        round takes, whoever trained it). `in_features` is target module -> input features."""
        update, norm = privatize(
            result.update, clip_norm=task.clip_norm, noise_std=plan.update_noise_std
        )
        self.state.privacy.commit(plan)  # spent once trained, whatever becomes of the upload
        self.state.save()
        if self.misbehaviour is not None:  # after clipping: an attacker ignores the protocol
            update = self.misbehaviour.corrupt(update, task.round)
        with phase("encode", f"round {task.round}"):
            payload = self.compress(update, task, spec, in_features)
        if self.persist_feedback:
            self.commit_feedback()
        raw_bytes = sum(t.numel() * 2 for t in update.values())  # as bf16
        self.on_event(RoundEvent("compressed", task.round, self._compressed(raw_bytes, payload)))
        metrics = train_metrics(
            result, update_norm=norm, raw_bytes=raw_bytes, payload_bytes=len(payload)
        )
        return signed_reply(self.identity, message, task, payload, {**metrics, **plan.metrics()})

    def _step_events(self, round: int) -> Callable[[StepInfo], None]:
        """Tell the front end about each training step of `round`."""

        def step(info: StepInfo) -> None:
            detail: dict[str, float | str] = {
                "step": info.step,
                "steps": info.steps,
                "loss": info.loss,
                "tokens_per_s": info.tokens_per_s,
            }
            if info.reward is not None:
                detail["reward"] = info.reward
            self.on_event(RoundEvent("step", round, detail))

        return step

    def compress(
        self, update: Delta, task: TaskConfig, spec: LoraSpec, in_features: dict[str, int]
    ) -> bytes:
        """The round's envelope: `update` plus the error-feedback residual, in the task's codec
        (see `compress_for_task`)."""
        return compress_for_task(
            self.feedback, update, task, spec, in_features, honest=self.misbehaviour is None
        )

    def _compressed(self, raw_bytes: int, payload: bytes) -> dict[str, float | str]:
        """The "compressed" event's detail: sizes, and what a change of A dropped."""
        detail: dict[str, float | str] = {
            "raw_bytes": raw_bytes,
            "payload_bytes": len(payload),
            "residual_bytes": self.feedback.nbytes(),
            "update_bytes": self.feedback.update_bytes,
        }
        change = self.feedback.last_change
        if change is not None:
            detail.update(
                carried_norm=change.carried,
                dropped_norm=change.dropped,
                dropped_share=change.dropped_share,
            )
        return detail

    def commit_feedback(self) -> None:
        """Save the error-feedback residual of the last compressed round."""
        self.feedback.save(self.home / "feedback.safetensors")

    def revert_feedback(self) -> None:
        """Drop the last round's residual change: back to the one saved last."""
        self.feedback = FfaErrorFeedback.load(
            self.home / "feedback.safetensors", enabled=self.feedback.enabled
        )

    def _dp_config(self, plan: PrivacyPlan, trainer: Trainer) -> DpConfig | None:
        """DP-SGD settings for the trainer (None: no DP-SGD); tells the front end what was planned."""
        self.on_event(RoundEvent("privacy", plan.round, dict(plan.metrics())))
        if not plan.dp_sgd:
            return None
        try:
            trainer.check_dp()
        except ValueError as exc:
            raise PrivacyRefusal(f"round {plan.round}: {exc}") from None
        return DpConfig(
            max_grad_norm=plan.dp_max_grad_norm,
            noise_multiplier=plan.dp_noise_multiplier,
            sample_rate=plan.sample_rate,
        )

    def run_objective(
        self,
        trainer: Trainer,
        task: TaskConfig,
        on_step: Callable[[StepInfo], None],
        dp: DpConfig | None = None,
    ) -> RoundResult:
        """Train one round with the task's objective: SFT, or GRPO / GSPO on a reward."""
        if task.method == "sft":
            return trainer.train_round(
                self.conversations,
                seed=task.seed,
                steps=task.steps,
                lr=task.learning_rate,
                batch_size=task.batch_size,
                max_length=task.max_length,
                on_step=on_step,
                dp=dp,
                a_seed=task.a_seed,
            )
        if task.method not in POLICY_OBJECTIVES:
            raise ValueError(f"unknown training method {task.method!r}; update zoo-gym")
        from zoo_gym.client.trainers.grpo import train_grpo
        from zoo_gym.client.trainers.reward_functions import load_reward_functions
        from zoo_gym.core.chat import prompts_from_conversations

        rewards = load_reward_functions(task.reward_functions, self.reward_functions)
        return train_grpo(
            trainer,
            prompts_from_conversations(self.conversations),
            objective=task.method,
            seed=task.seed,
            steps=task.steps,
            lr=task.learning_rate,
            batch_size=task.batch_size,
            num_generations=task.num_generations,
            max_new_tokens=task.max_new_tokens,
            temperature=task.temperature,
            clip_epsilon=task.clip_epsilon,
            kl_beta=task.kl_beta,
            rewards=rewards,
            max_length=task.max_length,
            on_step=on_step,
            a_seed=task.a_seed,
            dp=dp,
        )


def task_spec(task: TaskConfig) -> LoraSpec:
    """The LoRA rank, alpha and target modules `task` names."""
    return LoraSpec(rank=task.lora_rank, alpha=task.lora_alpha, target_modules=task.target_modules)


def compress_for_task(
    feedback: FfaErrorFeedback,
    update: Delta,
    task: TaskConfig,
    spec: LoraSpec,
    in_features: dict[str, int],
    *,
    honest: bool,
) -> bytes:
    """The round's envelope: `update` plus the error-feedback residual in `feedback`, in the
    task's codec, and the carried Bs of an epoch's first round in its carry codec
    (`carry_spec`). With a clip norm, an honest compensated update is capped at
    `feedback_cap`, the norm the coordinator's intake bound is built on (an attacker's is
    not capped)."""
    codec = CodecSpec(codec=task.codec, group_size=task.group_size, granularity=task.granularity)
    d = sum(t.numel() for t in update.values())
    cap = feedback_cap(task.clip_norm, task.update_noise_multiplier, d)
    payload, _ = feedback.compress(
        update,
        codec,
        lora=spec,
        seed=task.a_seed,
        carry_seed=task.carry_seed,
        in_features=in_features,
        max_norm=cap if honest else 0.0,
        round=task.round,
        carry_codec=carry_spec(codec, task.carry_codec),
    )
    return payload


def privatize(update: Delta, *, clip_norm: float, noise_std: float) -> tuple[Delta, float]:
    """Clip `update` to L2 norm `clip_norm` (0: no clipping), then add Gaussian noise of std
    `noise_std` (0: none; the user-level mechanism, from a CSPRNG-seeded generator).

    Returns the update and its norm before clipping (0.0 when not clipped).
    """
    norm = 0.0
    if clip_norm > 0:
        update, norm = clip_delta(update, clip_norm)
    if noise_std > 0:
        update = add_gaussian_noise(update, std=noise_std, generator=secure_generator())
    return update, norm


def train_metrics(
    result: RoundResult, *, update_norm: float, raw_bytes: int, payload_bytes: int
) -> dict[str, float]:
    """The submission's training metrics (the privacy plan's metrics go beside them)."""
    return {
        "num_examples": float(result.num_examples),
        "train_loss": result.mean_loss,
        "tokens": float(result.tokens),
        "train_seconds": result.seconds,
        "update_norm": update_norm,
        "raw_bytes": float(raw_bytes),
        "payload_bytes": float(payload_bytes),
    }


def signed_reply(
    identity: Identity,
    message: Message,
    task: TaskConfig,
    payload: bytes,
    metrics: dict[str, int | float | list[int] | list[float]],
) -> Message:
    """Sign `payload` as `identity`'s update for `task` and wrap it as the reply to `message`."""
    submission = SignedSubmission(
        contributor_id=identity.contributor_id,
        round=task.round,
        base_version=task.base_version,
        message_id=message.metadata.message_id,
        nonce=os.urandom(16),
        payload_sha256=hashlib.sha256(payload).hexdigest(),
        payload_size=len(payload),
    ).signed(identity)
    record = ConfigRecord({**submission.to_record(), PAYLOAD: payload})
    content = RecordDict({SUBMISSION: record, TRAIN_METRICS: MetricRecord(metrics)})
    return Message(content, reply_to=message)
