"""Operators' hold on the round loop: pause, resume, abort a round, start the next one now, and
policy changes staged for the next round.

The REST API writes requests into one `RoundControl`; the round loop reads them at fixed points
and is the only one that acts on them, so a request never changes a round half way:

    while not co.stop.is_set() and ...:
        if not control.wait_until_runnable(co.stop):   # between rounds: blocks while paused
            break
        change = control.take_policy()                  # staged policy applies from this round on
        if change is not None:
            co.config = change.config                   # and rebuild what was built from it
        control.round_started(number)
        ...                                             # open, send tasks, collect replies
        abort = control.abort_requested(number)         # before aggregating (and while collecting)
        if abort is not None:
            ...                                         # close the round as "aborted", abort.reason
        ...
        control.round_finished(number)

Every method is thread-safe (one lock); none does I/O. Requests carry who made them (`by`, the
API principal's actor name) and why, so the loop can write them into the round's metrics.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, ValidationError

from zoo_gym.coordinator.config import CoordinatorConfig

NOT_POLICY: frozenset[str] = frozenset(
    {
        "home",
        "listen",
        "rest_listen",
        "database_url",
        "base_model",
        "validation_data",
        "signing_key",
        "checkpoint_copy",
        "tls_cert",
        "tls_key",
        "seed",
        "rounds",
    }
)
"""Top-level settings that are not policy: addresses, files, keys, the database, the run's seed
and length. They change only by editing coordinator.toml and restarting (an API key must not be
able to redirect or switch off `checkpoint_copy`, the record kept against the database)."""


class PolicyError(ValueError):
    """A policy change names an unknown setting or a value the config model refuses."""


def _now() -> datetime:
    return datetime.now(UTC)


@dataclass(frozen=True)
class Request:
    """An operator's request: who made it (`by`), why, and when."""

    by: str
    reason: str = ""
    at: datetime = field(default_factory=_now)


@dataclass(frozen=True)
class PolicyChange:
    """A validated configuration staged for the next round.

    `config` is the whole coordinator configuration to run the next round with; `changes` maps
    each changed setting (dotted, e.g. ``training.clip_norm``) to (value now, value staged).
    """

    config: CoordinatorConfig
    changes: dict[str, tuple[Any, Any]]
    by: str
    at: datetime = field(default_factory=_now)


@dataclass(frozen=True)
class ControlState:
    """A snapshot of every pending request, for the API and for metrics."""

    paused: Request | None
    start: Request | None
    aborts: dict[int, Request]
    current_round: int | None
    policy: PolicyChange | None


class RoundControl:
    """Pending operator requests, written by the API and consulted by the round loop."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._paused: Request | None = None
        self._start: Request | None = None
        self._aborts: dict[int, Request] = {}
        self._current: int | None = None
        self._policy: PolicyChange | None = None

    # -- operator side (REST API) ----------------------------------------------------------------

    def pause(self, *, by: str, reason: str = "") -> None:
        """Start no new round until `resume` (the round under way, if any, finishes normally)."""
        with self._cond:
            self._paused = Request(by, reason)
            self._cond.notify_all()

    def resume(self, *, by: str) -> bool:
        """Lift a pause; False when rounds were not paused."""
        with self._cond:
            was_paused = self._paused is not None
            self._paused = None
            self._cond.notify_all()
            return was_paused

    def request_start(self, *, by: str, reason: str = "") -> None:
        """Run the next round now even while paused: one round, after which a pause holds again.

        Without a pause the loop starts rounds on its own and the request is spent at the next
        `wait_until_runnable`.
        """
        with self._cond:
            self._start = Request(by, reason)
            self._cond.notify_all()

    def request_abort(self, round_number: int, *, by: str, reason: str) -> None:
        """Ask the loop to abort round `round_number`: it aggregates and publishes nothing."""
        with self._cond:
            self._aborts[round_number] = Request(by, reason)
            self._cond.notify_all()

    def stage_policy(self, change: PolicyChange | None) -> None:
        """Stage `change` for the next round, replacing any change staged before (None: drop it)."""
        with self._cond:
            self._policy = change

    def pending_policy(self) -> PolicyChange | None:
        with self._cond:
            return self._policy

    @property
    def paused(self) -> bool:
        with self._cond:
            return self._paused is not None

    def state(self) -> ControlState:
        with self._cond:
            return ControlState(
                self._paused, self._start, dict(self._aborts), self._current, self._policy
            )

    # -- round loop side -------------------------------------------------------------------------

    def wait_until_runnable(self, stop: threading.Event, *, poll_s: float = 0.25) -> bool:
        """Block between rounds while paused; True when the next round may start, False on stop.

        Returns at once when not paused. While paused it returns True for a start request (which
        it spends) and False as soon as `stop` is set (checked every `poll_s` seconds).
        """
        with self._cond:
            while True:
                if stop.is_set():
                    return False
                if self._paused is None or self._start is not None:
                    self._start = None
                    return True
                self._cond.wait(poll_s)

    def take_policy(self) -> PolicyChange | None:
        """The change staged since the last call (then cleared), or None.

        The caller runs the next round with `change.config` and assigns it to `Coordinator.config`
        (the API shows that as the current policy and merges later changes onto it).
        """
        with self._cond:
            change, self._policy = self._policy, None
            return change

    def round_started(self, number: int) -> None:
        """Mark round `number` as under way; older abort requests are dropped."""
        with self._cond:
            self._current = number
            self._aborts = {n: r for n, r in self._aborts.items() if n >= number}

    def abort_requested(self, number: int) -> Request | None:
        """The abort request for round `number`, if an operator made one (it is not consumed)."""
        with self._cond:
            return self._aborts.get(number)

    def round_finished(self, number: int) -> None:
        """Round `number` is closed: forget its abort request."""
        with self._cond:
            self._aborts.pop(number, None)
            if self._current == number:
                self._current = None


# --- policy -------------------------------------------------------------------------------------

Settings = dict[str, Any]


def policy_settings(config: CoordinatorConfig) -> Settings:
    """The policy part of `config` as JSON values (every setting not in `NOT_POLICY`)."""
    dumped = config.model_dump(mode="json")
    return {k: v for k, v in dumped.items() if k not in NOT_POLICY}


def _sections(model: type[BaseModel]) -> dict[str, type[BaseModel]]:
    """Settings of `model` that are sections (pydantic models) rather than values."""
    out: dict[str, type[BaseModel]] = {}
    for name, info in model.model_fields.items():
        if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel):
            out[name] = info.annotation
    return out


def flatten_settings(
    values: Settings, model: type[BaseModel] = CoordinatorConfig, prefix: str = ""
) -> Settings:
    """{"training": {"clip_norm": 1}} -> {"training.clip_norm": 1}. Only sections are opened; a
    setting whose value is a dict (aggregator_params) stays one setting."""
    sections = _sections(model)
    flat: Settings = {}
    for key, value in values.items():
        if key in sections and isinstance(value, dict):
            flat.update(flatten_settings(value, sections[key], f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _nest(patch: Settings, model: type[BaseModel], prefix: str = "") -> Settings:
    """Check every key of `patch` against `model` and open dotted keys into sections."""
    fields, sections = model.model_fields, _sections(model)
    nested: Settings = {}
    for dotted, value in patch.items():
        key, _, rest = dotted.partition(".")
        name = f"{prefix}{key}"
        if not prefix and key in NOT_POLICY:
            raise PolicyError(
                f"{name} is not a policy setting; it changes only by editing coordinator.toml "
                "and restarting"
            )
        if key not in fields:
            known = sorted(f"{prefix}{k}" for k in fields if prefix or k not in NOT_POLICY)
            raise PolicyError(f"{name} is not a setting; settable here: {', '.join(known)}")
        if rest and key not in sections:
            raise PolicyError(f"{prefix}{dotted}: {name} is a setting, not a section")
        if rest:
            value = {rest: value}
        if key in sections and isinstance(value, dict):
            value = {**nested.get(key, {}), **_nest(value, sections[key], f"{name}.")}
        nested[key] = value
    return nested


def _merge(base: Settings, patch: Settings, model: type[BaseModel]) -> Settings:
    """`base` with `patch` applied: sections merge key by key, every other value is replaced."""
    sections = _sections(model)
    merged = dict(base)
    for key, value in patch.items():
        if key in sections and isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value, sections[key])
        else:
            merged[key] = value
    return merged


def merge_policy(
    config: CoordinatorConfig, patch: Settings
) -> tuple[CoordinatorConfig, dict[str, tuple[Any, Any]]]:
    """Apply a merge patch of policy settings to `config` and validate the result.

    `patch` names settings as nested sections (``{"training": {"clip_norm": 1.0}}``) or dotted
    keys (``{"training.clip_norm": 1.0}``); a value replaces the setting's value. The merged
    document is validated by `CoordinatorConfig` itself, so the API accepts exactly what
    coordinator.toml accepts. Returns the new configuration and the changed settings, dotted ->
    (old, new). Raises `PolicyError` with one line naming the setting and what is wrong.
    """
    if not patch:
        raise PolicyError("the change is empty; name at least one setting, e.g. aggregator")
    nested = _nest(patch, CoordinatorConfig)
    try:
        updated = CoordinatorConfig.model_validate(
            _merge(config.model_dump(), nested, CoordinatorConfig)
        )
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "policy"
        message = err["msg"].removeprefix("Value error, ")
        shown = (
            f" (got {err['input']!r})" if err["loc"] and not isinstance(err["input"], dict) else ""
        )
        raise PolicyError(f"{where}: {message}{shown}") from None
    except TypeError as exc:  # a rule refusing an unknown parameter while the model validates
        raise PolicyError(f"aggregator_params: {exc}") from None
    return updated, diff_policy(config, updated)


def diff_policy(old: CoordinatorConfig, new: CoordinatorConfig) -> dict[str, tuple[Any, Any]]:
    """Policy settings that differ, dotted -> (old, new)."""
    before = flatten_settings(policy_settings(old))
    after = flatten_settings(policy_settings(new))
    return {k: (before.get(k), v) for k, v in after.items() if before.get(k) != v}
