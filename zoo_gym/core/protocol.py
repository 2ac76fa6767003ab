"""What client and coordinator agree on, independent of the wire.

The transport moves these values; the client produces them and the coordinator
checks them. Every signed byte string starts with a domain-separation prefix
and the protocol version, so a signature for one purpose is never valid for
another.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Literal, TypeAlias, TypeVar, get_args

from zoo_gym.core.hashing import canonical_json
from zoo_gym.core.identity import Identity

PROTOCOL_VERSION = 1
PREFIX = f"zoo-gym/v{PROTOCOL_VERSION}"

# Keys of the Flower RecordDict exchanged by the ServerApp and ClientApp.
TASK_CONFIG = "task"
SUBMISSION = "submission"
TRAIN_METRICS = "metrics"
PAYLOAD = "payload"

RecordValue: TypeAlias = (
    int
    | float
    | str
    | bytes
    | bool
    | list[int]
    | list[float]
    | list[str]
    | list[bytes]
    | list[bool]
)
"""A value of a Flower ConfigRecord (core does not import Flower; a ConfigRecord is a Mapping)."""
_V = TypeVar("_V", int, str, bytes, bool)


class MalformedRecord(ValueError):
    """A record lacks a field, or holds one of the wrong type."""


def _field(record: Mapping[str, object], what: str, name: str, kind: type[_V]) -> _V:
    """`record[name]`, which must be a `kind` (a bool is not an int here)."""
    if name not in record:
        raise MalformedRecord(f"the {what} record has no {name!r} field")
    value = record[name]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise MalformedRecord(
            f"the {what} record's {name!r} is {type(value).__name__}, not {kind.__name__}"
        )
    return value


def payload_of(record: Mapping[str, object]) -> bytes:
    """The update bytes a ClientApp put beside its signed submission (under PAYLOAD)."""
    return _field(record, SUBMISSION, PAYLOAD, bytes)


def register_statement(public_key: bytes, name: str, timestamp_ms: int) -> bytes:
    """Bytes a contributor signs to register `public_key`."""
    return f"{PREFIX}|register|{public_key.hex()}|{name}|{timestamp_ms}".encode()


@dataclass(frozen=True)
class SignedRegistration:
    """A contributor's signed request to register its key under `name` (`register_statement`),
    as an in-process or simulated node hands it to the coordinator in a ConfigRecord."""

    public_key: bytes
    name: str
    timestamp_ms: int
    signature: bytes

    @classmethod
    def now(cls, identity: Identity, name: str, timestamp_ms: int) -> SignedRegistration:
        statement = register_statement(identity.public_key, name, timestamp_ms)
        return cls(identity.public_key, name, timestamp_ms, identity.sign(statement))

    def to_record(self) -> dict[str, RecordValue]:
        return {
            "public_key": self.public_key,
            "name": self.name,
            "timestamp_ms": self.timestamp_ms,
            "signature": self.signature,
        }

    @classmethod
    def from_record(cls, record: Mapping[str, object]) -> SignedRegistration:
        """Inverse of `to_record`; raises MalformedRecord when a field is missing or mistyped."""
        return cls(
            public_key=_field(record, "registration", "public_key", bytes),
            name=_field(record, "registration", "name", str),
            timestamp_ms=_field(record, "registration", "timestamp_ms", int),
            signature=_field(record, "registration", "signature", bytes),
        )


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

    def signed(self, identity: Identity) -> SignedSubmission:
        """This statement with `identity`'s signature over it."""
        return replace(self, signature=identity.sign(self.statement()))

    def to_record(self) -> dict[str, RecordValue]:
        """Every field, for the ConfigRecord under SUBMISSION (the payload goes beside them)."""
        return {
            "contributor_id": self.contributor_id,
            "round": self.round,
            "base_version": self.base_version,
            "message_id": self.message_id,
            "nonce": self.nonce,
            "payload_sha256": self.payload_sha256,
            "payload_size": self.payload_size,
            "signature": self.signature,
        }

    @classmethod
    def from_record(cls, record: Mapping[str, object]) -> SignedSubmission:
        """Inverse of `to_record` (other keys, such as PAYLOAD, are left alone).

        Raises MalformedRecord when a field is missing or of the wrong type.
        """
        return cls(
            contributor_id=_field(record, SUBMISSION, "contributor_id", str),
            round=_field(record, SUBMISSION, "round", int),
            base_version=_field(record, SUBMISSION, "base_version", str),
            message_id=_field(record, SUBMISSION, "message_id", str),
            nonce=_field(record, SUBMISSION, "nonce", bytes),
            payload_sha256=_field(record, SUBMISSION, "payload_sha256", str),
            payload_size=_field(record, SUBMISSION, "payload_size", int),
            signature=_field(record, SUBMISSION, "signature", bytes),
        )


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
class IntakeResult:
    """What the ServerApp sees of one submission after intake (the ConfigRecord under
    SUBMISSION of the reply it pulls): whose it is, the verdict, and the stored payload's hash,
    which names its file."""

    contributor_id: str
    accepted: bool
    reason: str
    submission_id: int
    payload_sha256: str
    payload_size: int

    @classmethod
    def of(cls, sub: SignedSubmission, verdict: Verdict) -> IntakeResult:
        return cls(
            contributor_id=sub.contributor_id,
            accepted=verdict.accepted,
            reason=verdict.reason,
            submission_id=verdict.submission_id,
            payload_sha256=sub.payload_sha256,
            payload_size=sub.payload_size,
        )

    def to_record(self) -> dict[str, RecordValue]:
        return {
            "contributor_id": self.contributor_id,
            "accepted": self.accepted,
            "reason": self.reason,
            "submission_id": self.submission_id,
            "payload_sha256": self.payload_sha256,
            "payload_size": self.payload_size,
        }

    @classmethod
    def from_record(cls, record: Mapping[str, object]) -> IntakeResult:
        """Inverse of `to_record`; raises MalformedRecord when a field is missing or mistyped."""
        return cls(
            contributor_id=_field(record, "intake result", "contributor_id", str),
            accepted=_field(record, "intake result", "accepted", bool),
            reason=_field(record, "intake result", "reason", str),
            submission_id=_field(record, "intake result", "submission_id", int),
            payload_sha256=_field(record, "intake result", "payload_sha256", str),
            payload_size=_field(record, "intake result", "payload_size", int),
        )


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
"""What a round trains. ``ffa_lora`` sends the B matrices (A frozen from the task's ``a_seed``);
``lora``, ``dora`` and ``qlora`` train free factors and send the dense delta of the target
modules' weights; ``full`` trains every weight and sends the dense delta of all of them."""

DEFAULT_TARGETS = (
    *("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    *("qkv_proj", "gate_up_proj"),
    *("c_attn", "c_proj", "c_fc"),
)
"""Linear layers LoRA adapts by default: the attention and MLP projections of Llama, Mistral and
Qwen2 models, of Phi-3 (fused ``qkv_proj`` and ``gate_up_proj``) and of GPT-2 (``Conv1D``
``c_attn``, ``c_proj``, ``c_fc``). A name matches the last part of a module's name; names a base
does not have match nothing, and a base none of them matches is refused (`zoo_gym.core.lora.for_base`)."""

BUILTIN_REWARDS = ("exact_answer", "format", "length", "closeness")
"""Reward functions a task may name; a contributor's own ones come from its local config."""


@dataclass(frozen=True)
class TaskConfig:
    """The round task a ClientApp receives (the ConfigRecord under TASK_CONFIG).

    Field names match `zoo_gym.coordinator.config.TrainingPolicy`, which fills them. `seed`
    is the round's (data order, sampling); `a_seed` names the frozen LoRA A, which stays for
    ``lora_a_rounds`` rounds. A task without `a_seed` (an older coordinator's, or -1) uses
    `seed` for A as well. `carry_a_seed` is set (>= 0) only in the first round of an epoch of
    A after the first: it names the previous epoch's A, and the FFA update then carries the
    client's error-feedback residual for that A as a second B per module
    (``"<module>.lora_B_carry"``); -1 (the default, and an older coordinator's task) carries
    nothing. The carried Bs are compressed with `carry_codec` (same group size and
    granularity as `codec`); "" (an older coordinator's task) means `codec` itself.
    """

    round: int
    base_version: str
    seed: int
    a_seed: int = -1
    carry_a_seed: int = -1
    lora_a_rounds: int = 1
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
    carry_codec: str = ""  # of the carried Bs; "" = `codec`
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

    def __post_init__(self) -> None:
        if self.a_seed < 0:
            object.__setattr__(self, "a_seed", self.seed)

    @property
    def carry_seed(self) -> int | None:
        """`carry_a_seed`, or None when the round carries nothing."""
        return self.carry_a_seed if self.carry_a_seed >= 0 else None

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
