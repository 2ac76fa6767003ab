"""`gym-client join`: the contributor's long-lived loop.

Register, pin the coordinator key, fetch the current base, then: long-poll for
a task, run the ClientApp on it, stream the reply up, report the decision, and
later the round's outcome. Ctrl-C leaves between calls; nothing accepted is lost.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from flwr.app import Context, RecordDict
from flwr.clientapp import ClientApp

from zoo_gym.client.app import make_client_app
from zoo_gym.client.byzantine import Misbehaviour
from zoo_gym.client.config import ClientConfig
from zoo_gym.client.data import load_records
from zoo_gym.client.device import DeviceError, describe_device, resolve_device
from zoo_gym.client.link import Link
from zoo_gym.client.runtime import ClientRuntime, ModelSource, RoundEvent
from zoo_gym.client.state import RoundRecord
from zoo_gym.client.user_app import UserAppError, load_client_app
from zoo_gym.core.chat import Conversation
from zoo_gym.core.identity import Identity
from zoo_gym.core.manifest import read_verified
from zoo_gym.core.phases import phase
from zoo_gym.core.protocol import ALREADY_ACCEPTED, Registration
from zoo_gym.transport.client import FederationClient, ReceivedTask, TransportError

log = logging.getLogger(__name__)


class JoinError(RuntimeError):
    """Joining cannot go on; the message says why and what to do."""


def join(
    config: ClientConfig,
    *,
    stop: threading.Event | None = None,
    on_event: Callable[[RoundEvent], None] | None = None,
    say: Callable[[str], None] = print,
) -> int:
    """Contribute until `max_rounds` submissions were made or `stop` is set; returns submissions made."""
    stop = stop or threading.Event()
    if not config.coordinator:
        raise JoinError("no coordinator address; pass HOST:PORT to `gym-client join`")
    if config.data is None and not config.app:
        raise JoinError("no training data; pass --data FILE.jsonl (or --app MODULE:APP)")
    try:
        device = resolve_device(config.device)
        user_app = load_client_app(config.app, app_dir=Path.cwd()) if config.app else None
    except (DeviceError, UserAppError) as exc:
        raise JoinError(str(exc)) from None
    conversations = []  # a ClientApp of the contributor's own loads its own data
    if config.data is not None and user_app is None:
        conversations = load_records(config.path(config.data))
    identity = Identity.load(config.path(config.key))
    client = _federation_client(config, identity)
    link = Link(
        client,
        config.name,
        reconnect_for_s=config.reconnect_for_s,
        stop=stop,
        say=say,
        invite=config.invite,
    )
    try:
        reg = link.register()
        source = _verified_models(link, reg.coordinator_key, say)
        runtime = _runtime(config, device, identity, conversations, source, on_event)
        _pin_coordinator(runtime, config, reg)
        examples = (
            f"your ClientApp {config.app}" if config.app else f"{len(conversations)} local examples"
        )
        say(
            f"joined {config.coordinator} as {reg.contributor_id[:16]} ({reg.status}); "
            f"{examples}; current base {reg.current_version}"
        )
        say(f"device: {describe_device(device)}")
        if reg.status == "banned":
            raise JoinError("this key is banned by the operator")
        context = Context(
            run_id=1,
            node_id=reg.node_id,
            node_config=dict(config.node_config),
            state=RecordDict(),
            run_config={},
        )
        app = make_client_app(runtime, user_app)
        session = _Session(config, link, runtime, app, context, stop, say)
        return session.contribute()
    finally:
        client.close()


def _federation_client(config: ClientConfig, identity: Identity) -> FederationClient:
    """The gRPC client to `config.coordinator`, on a clock shifted by `clock_offset_s`."""
    roots = config.path(config.ca_cert).read_bytes() if config.ca_cert else None
    offset = config.clock_offset_s
    return FederationClient(
        config.coordinator,
        identity,
        root_certificates=roots,
        plaintext=True if config.plaintext else None,
        clock=(lambda: time.time() + offset) if offset else time.time,
    )


def _verified_models(link: Link, coordinator_key: bytes, say: Callable[[str], None]) -> ModelSource:
    """A model source that keeps a version on disk while it passes its signature check and
    downloads it (again) otherwise."""

    def fetch(version: str, directory: Path) -> None:
        if link.call(lambda: link.client.fetch_model(version, directory, coordinator_key)) is None:
            raise JoinError(f"stopped before {version} was downloaded")

    def source(version: str, directory: Path) -> None:
        try:
            read_verified(directory, coordinator_key)
        except FileNotFoundError:
            fetch(version, directory)
        except (OSError, ValueError) as exc:
            say(f"model {version} on disk failed its check ({exc}); downloading it again")
            fetch(version, directory)

    return source


def _runtime(
    config: ClientConfig,
    device: str,
    identity: Identity,
    conversations: list[Conversation],
    source: ModelSource,
    on_event: Callable[[RoundEvent], None] | None,
) -> ClientRuntime:
    """The runtime `config` describes on `device`, with its local state under HOME/state."""
    runtime = ClientRuntime(
        identity=identity,
        conversations=conversations,
        home=config.home / "state",
        model_source=source,
        device=device,
        on_event=on_event,
        misbehaviour=Misbehaviour(config.byzantine) if config.byzantine else None,
        reward_functions=config.reward_functions,
        error_feedback=config.error_feedback,
        gradient_checkpointing=config.gradient_checkpointing,
        max_full_params=config.max_full_params,
        privacy_budget=config.privacy_budget(),
        method=config.method,
    )
    runtime.persist_feedback = False  # saved once the coordinator holds the update
    return runtime


def _pin_coordinator(runtime: ClientRuntime, config: ClientConfig, reg: Registration) -> None:
    """Trust the coordinator's key on first contact; refuse a different one later."""
    state = runtime.state
    if state.coordinator_key and state.coordinator_key != reg.coordinator_key.hex():
        raise JoinError(
            f"the coordinator at {config.coordinator} signs with a different key than the one pinned in "
            f"{state.path}; if the operator rotated it, delete that file to trust the new key"
        )
    state.coordinator = config.coordinator
    state.coordinator_key = reg.coordinator_key.hex()
    state.contributor_id = reg.contributor_id
    state.save()


@dataclass(frozen=True)
class _Session:
    """A registered contributor's loop: poll for a task, train, submit, say what became of it."""

    config: ClientConfig
    link: Link
    runtime: ClientRuntime
    app: ClientApp
    context: Context
    stop: threading.Event
    say: Callable[[str], None]

    def contribute(self) -> int:
        """Take rounds until `max_rounds` submissions or `stop`; returns submissions made."""
        config, client, runtime = self.config, self.link.client, self.runtime
        made = 0
        while not self.stop.is_set() and (config.max_rounds == 0 or made < config.max_rounds):
            _report_outcomes(client, runtime, self.say)
            task = self.link.call(lambda: client.poll(config.poll_wait_s))
            if task is None:
                continue
            if runtime.state.submitted(task.round):
                self.say(
                    f"round {task.round}: already submitted from this machine; not submitting twice"
                )
                self.stop.wait(config.poll_wait_s)
                continue
            if not self.submit(task):
                break
            made += 1
        wait_s = config.poll_wait_s if made else 0.0
        _report_outcomes(client, runtime, self.say, wait_s=wait_s, stop=self.stop)
        return made

    def submit(self, task: ReceivedTask) -> bool:
        """Train on `task` and upload the reply; False when stopped while the coordinator was out
        of reach. The error-feedback residual is kept only once the coordinator holds the update."""
        self.say(f"round {task.round}: training on {task.base_version}")
        try:
            reply = self.app(task.message, self.context)
        except UserAppError as exc:  # the contributor's own ClientApp replied with no update
            raise JoinError(str(exc)) from None
        with phase("upload", f"round {task.round}"):
            result = self.link.submit(task, reply)
        if result is None:
            self.runtime.revert_feedback()
            return False
        metrics = reply.content.metric_records["metrics"]
        done = result.accepted or already_accepted(result.reason)
        if done:  # the coordinator holds the update: what compression dropped carries over
            self.runtime.commit_feedback()
        else:
            self.runtime.revert_feedback()
        self.runtime.state.record(
            RoundRecord(
                round=task.round,
                message_id=task.message.metadata.message_id,
                base_version=task.base_version,
                decision="accepted" if done else "rejected",
                reason=result.reason,
                payload_bytes=result.payload_bytes,
                raw_bytes=int(_scalar(metrics["raw_bytes"])),
                train_loss=_scalar(metrics["train_loss"]),
            )
        )
        if done and not result.accepted:  # accepted before a crash kept us from recording it
            self.say(
                f"round {task.round}: the coordinator already holds this machine's update; done"
            )
        else:
            self.say(
                f"round {task.round}: uploaded {result.payload_bytes} bytes "
                f"(bf16 would be {int(_scalar(metrics['raw_bytes']))}); "
                f"{'accepted' if result.accepted else 'REJECTED'}: {result.reason}"
            )
        return True


def _report_outcomes(
    client: FederationClient,
    runtime: ClientRuntime,
    say: Callable[[str], None],
    *,
    wait_s: float = 0.0,
    stop: threading.Event | None = None,
) -> None:
    """Tell the contributor what became of earlier submissions once their rounds closed."""
    deadline = time.monotonic() + wait_s
    while True:
        pending = [c for c in runtime.state.contributions.values() if not c.final]
        for c in pending:
            try:
                out = client.outcome(c.round)
            except TransportError:
                return
            if out.round_status in ("", "open", "aggregating"):
                continue
            c.final, c.quality, c.reward = True, out.quality, out.reward
            c.decision, c.reason = out.decision, out.reason
            runtime.state.record(c)
            say(
                f"round {c.round} closed ({out.round_status}{', now ' + out.published_version if out.published_version else ''}): "
                f"your update {out.decision}, reward {out.reward:g} (quality {out.quality:+.4g}): {out.reason}"
            )
        if (
            all(c.final for c in runtime.state.contributions.values())
            or time.monotonic() > deadline
        ):
            return
        if stop is not None and stop.wait(0.5):
            return


def already_accepted(reason: str) -> bool:
    """Whether a refusal says this contributor's update for the round is already in.

    A client killed after the coordinator accepted its update but before it recorded that
    locally trains the round again on restart; the coordinator refuses the second upload
    with this reason, and the round counts as done, not failed.
    """
    return reason.startswith(ALREADY_ACCEPTED)


def _scalar(value: object) -> float:
    return float(value) if isinstance(value, int | float) else 0.0
