"""What client and coordinator agree on, independent of the wire.

The transport moves these values; the client produces them and the coordinator
checks them. Every signed byte string starts with a domain-separation prefix
and the protocol version, so a signature for one purpose is never valid for
another.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Literal, get_args

from zoo_gym.core.hashing import canonical_json

PROTOCOL_VERSION = 1
PREFIX = f"zoo-gym/v{PROTOCOL_VERSION}"

# Keys of the Flower RecordDict exchanged by the ServerApp and ClientApp.
TASK_CONFIG = "task"
SUBMISSION = "submission"
TRAIN_METRICS = "metrics"
PAYLOAD = "payload"


def register_statement(public_key: bytes, name: str, timestamp_ms: int) -> bytes:
    """Bytes a contributor signs to register `public_key`."""
    return f"{PREFIX}|register|{public_key.hex()}|{name}|{timestamp_ms}".encode()


REQUEST_PREFIX = "zoo-gym/request/v2"
CALL_NONCE_BYTES = 16


def request_statement(
    method: str, contributor_id: str, timestamp_ms: int, nonce: bytes, digest: str
) -> bytes:
    """Bytes a contributor signs to authenticate one call (`digest` names its arguments).

    `nonce` is CALL_NONCE_BYTES random bytes, fresh for every call: the coordinator accepts
    each (contributor, nonce) once, so a captured call cannot be sent again. Version 2 of the
    statement (version 1 had no nonce) has its own prefix, so no signature of one version is
    valid for the other.
    """
    return (
        f"{REQUEST_PREFIX}|{method}|{contributor_id}|{timestamp_ms}|{nonce.hex()}|{digest}".encode()
    )


REST_AUTH_PREFIX = "zoo-gym/rest-auth/v1"


def rest_challenge_statement(contributor_id: str, nonce: str, expires_at_ms: int) -> bytes:
    """Bytes a contributor signs to answer a REST sign-in challenge (`POST /auth/challenge`).

    Its own prefix keeps it apart from every statement of the gRPC protocol; the contributor
    builds these bytes itself from the challenge, so it never signs bytes the server chose freely.
    """
    return f"{REST_AUTH_PREFIX}|{contributor_id}|{nonce}|{expires_at_ms}".encode()


@dataclass(frozen=True)
class SignedSubmission:
    """A contributor's signed claim: "this payload is my update for this round and base".

    The signature covers every field except `signature`, so a payload cannot be
    moved to another round, another base version or another contributor, and
    the nonce makes each statement unique (replays are refused by nonce).
    """

    contributor_id: str
    round: int
    base_version: str
    message_id: str
    nonce: bytes
    payload_sha256: str
    payload_size: int
    signature: bytes = b""

    def statement(self) -> bytes:
        body = {
            "contributor_id": self.contributor_id,
            "round": self.round,
            "base_version": self.base_version,
            "message_id": self.message_id,
            "nonce": self.nonce.hex(),
            "payload_sha256": self.payload_sha256,
            "payload_size": self.payload_size,
        }
        return f"{PREFIX}|submission|".encode() + canonical_json(body)


ALREADY_ACCEPTED = "you already have an accepted submission for round"
"""How intake's refusal of a second upload for a round begins: the first one counts, so a client
that reads it knows its update for that round is in."""


def already_accepted_reason(round_number: int) -> str:
    return f"{ALREADY_ACCEPTED} {round_number}; only one counts"


@dataclass(frozen=True)
class Verdict:
    """The coordinator's answer to a submission at intake."""

    accepted: bool
    reason: str
    submission_id: int = 0


@dataclass(frozen=True)
class Registration:
    contributor_id: str
    node_id: int
    status: str
    current_version: str
    coordinator_key: bytes


@dataclass(frozen=True)
class Outcome:
    decision: str
    reason: str
    quality: float = 0.0
    reward: float = 0.0
    round_status: str = ""
    published_version: str = ""


_SCALARS: dict[str, type] = {"int": int, "float": float, "str": str}


Objective = Literal["sft", "grpo", "gspo"]
OBJECTIVES: tuple[Objective, ...] = get_args(Objective)
"""What a round optimises: supervised fine-tuning, or GRPO / GSPO on a reward."""
PolicyObjective = Literal["grpo", "gspo"]
POLICY_OBJECTIVES: tuple[PolicyObjective, ...] = get_args(PolicyObjective)
"""The objectives that train a policy on a reward (the rest is supervised)."""

Adapter = Literal["ffa_lora", "lora", "dora", "qlora", "full"]
ADAPTERS: tuple[Adapter, ...] = get_args(Adapter)
"""What a round trains. ``ffa_lora`` sends the B matrices (A frozen from the round's seed);
``lora``, ``dora`` and ``qlora`` train free factors and send the dense delta of the target
modules' weights; ``full`` trains every weight and sends the dense delta of all of them."""

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Linear layers LoRA adapts by default (attention and MLP projections of Llama/Qwen models)."""

BUILTIN_REWARDS = ("exact_answer", "format", "length", "closeness")
"""Reward functions a task may name; a contributor's own ones come from its local config."""


@dataclass(frozen=True)
class TaskConfig:
    """The round task a ClientApp receives (the ConfigRecord under TASK_CONFIG).

    Field names match `zoo_gym.coordinator.config.TrainingPolicy`, which fills them.
    """

    round: int
    base_version: str
    seed: int
    method: str = "sft"  # one of OBJECTIVES
    adapter: str = "ffa_lora"  # one of ADAPTERS
    lora_rank: int = 8
    lora_alpha: float = 16.0
    target_modules: tuple[str, ...] = DEFAULT_TARGETS
    steps: int = 30
    learning_rate: float = 5e-3
    batch_size: int = 8
    max_length: int = 96
    clip_norm: float = 0.0
    codec: str = "bitdelta"
    group_size: int = 128
    granularity: str = "group"  # one scale per group_size values, per row or per matrix
    deadline_ms: int = 0
    # GRPO / GSPO: prompts per step are batch_size, completions per prompt num_generations
    num_generations: int = 4
    max_new_tokens: int = 8
    temperature: float = 1.0
    clip_epsilon: float = 0.2
    kl_beta: float = 0.04
    reward_functions: tuple[str, ...] = ("exact_answer",)  # names from BUILTIN_REWARDS
    # privacy (DESIGN.md, "Privacy"); 0 switches a mechanism off
    dp_noise_multiplier: float = 0.0  # DP-SGD sigma; with dp_target_epsilon > 0 the client picks it
    dp_max_grad_norm: float = 1.0  # DP-SGD per-example clipping norm C
    dp_target_epsilon: float = 0.0  # per round, at dp_delta
    dp_delta: float = 1e-5
    dp_accountant: str = "rdp"  # "rdp" or "prv"
    update_noise_multiplier: float = 0.0  # Gaussian noise std on the clipped update / clip_norm

    def to_record(self) -> dict[str, Any]:
        """Flat scalars and lists for a Flower ConfigRecord."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @classmethod
    def from_record(cls, record: Any) -> TaskConfig:
        """Inverse of `to_record`; scalar types are checked by the fields' own types.

        A field missing from the record takes its default, so an older coordinator's task
        still parses.
        """
        r = dict(record)
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name not in r:
                continue
            value = r[f.name]
            if isinstance(f.type, str) and f.type.startswith("tuple"):
                value = tuple(str(v) for v in value)
            elif isinstance(f.type, str) and f.type in _SCALARS:
                value = _SCALARS[f.type](value)
            values[f.name] = value
        return cls(**values)


class RequestError(Exception):
    """A request the coordinator refuses; `code` names the gRPC status to answer with.

    The message is one line for the contributor: what was wrong and what to do.
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
