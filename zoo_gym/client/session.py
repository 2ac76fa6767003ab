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
from pathlib import Path

from flwr.app import Context, RecordDict

from zoo_gym.client.app import make_client_app
from zoo_gym.client.byzantine import Misbehaviour
from zoo_gym.client.config import ClientConfig
from zoo_gym.client.data import load_records
from zoo_gym.client.link import Link
from zoo_gym.client.runtime import ClientRuntime, RoundEvent
from zoo_gym.client.state import Contribution
from zoo_gym.core.identity import Identity
from zoo_gym.core.manifest import read_verified
from zoo_gym.core.protocol import ALREADY_ACCEPTED
from zoo_gym.transport.client import FederationClient, TransportError

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
    if config.data is None:
        raise JoinError("no training data; pass --data FILE.jsonl")
    conversations = load_records(config.path(config.data))
    identity = Identity.load(config.path(config.key))
    roots = config.path(config.ca_cert).read_bytes() if config.ca_cert else None
    offset = config.clock_offset_s
    client = FederationClient(
        config.coordinator,
        identity,
        root_certificates=roots,
        plaintext=True if config.plaintext else None,
        clock=(lambda: time.time() + offset) if offset else time.time,
    )
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
        home = config.home
        runtime_home = home / "state"
        runtime_home.mkdir(parents=True, exist_ok=True)

        def fetch(version: str, directory: Path) -> None:
            if (
                link.call(lambda: client.fetch_model(version, directory, reg.coordinator_key))
                is None
            ):
                raise JoinError(f"stopped before {version} was downloaded")

        def source(version: str, directory: Path) -> None:
            try:
                read_verified(directory, reg.coordinator_key)
            except FileNotFoundError:
                fetch(version, directory)
            except (OSError, ValueError) as exc:
                say(f"model {version} on disk failed its check ({exc}); downloading it again")
                fetch(version, directory)

        runtime = ClientRuntime(
            identity=identity,
            conversations=conversations,
            home=runtime_home,
            model_source=source,
            device=config.device,
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
        pinned = runtime.state.coordinator_key
        if pinned and pinned != reg.coordinator_key.hex():
            raise JoinError(
                f"the coordinator at {config.coordinator} signs with a different key than the one pinned in "
                f"{runtime.state.path}; if the operator rotated it, delete that file to trust the new key"
            )
        runtime.state.coordinator = config.coordinator
        runtime.state.coordinator_key = reg.coordinator_key.hex()
        runtime.state.contributor_id = reg.contributor_id
        runtime.state.save()
        say(
            f"joined {config.coordinator} as {reg.contributor_id[:16]} ({reg.status}); "
            f"{len(conversations)} local examples; current base {reg.current_version}"
        )
        if reg.status == "banned":
            raise JoinError("this key is banned by the operator")
        app = make_client_app(runtime)
        context = Context(
            run_id=1, node_id=reg.node_id, node_config={}, state=RecordDict(), run_config={}
        )
        made = 0
        while not stop.is_set() and (config.max_rounds == 0 or made < config.max_rounds):
            _report_outcomes(client, runtime, say)
            task = link.call(lambda: client.poll(config.poll_wait_s))
            if task is None:
                continue
            if runtime.state.submitted(task.round):
                say(
                    f"round {task.round}: already submitted from this machine; not submitting twice"
                )
                stop.wait(config.poll_wait_s)
                continue
            say(f"round {task.round}: training on {task.base_version}")
            reply = app(task.message, context)
            result = link.submit(task, reply)
            if result is None:  # stopped while the coordinator was out of reach
                runtime.revert_feedback()
                break
            metrics = reply.content.metric_records["metrics"]
            done = result.accepted or already_accepted(result.reason)
            if done:  # the coordinator holds the update: what compression dropped carries over
                runtime.commit_feedback()
            else:
                runtime.revert_feedback()
            runtime.state.record(
                Contribution(
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
                say(
                    f"round {task.round}: the coordinator already holds this machine's update; done"
                )
                made += 1
                continue
            say(
                f"round {task.round}: uploaded {result.payload_bytes} bytes "
                f"(bf16 would be {int(_scalar(metrics['raw_bytes']))}); "
                f"{'accepted' if result.accepted else 'REJECTED'}: {result.reason}"
            )
            made += 1
        _report_outcomes(
            client, runtime, say, wait_s=config.poll_wait_s if made else 0.0, stop=stop
        )
        return made
    finally:
        client.close()


def _report_outcomes(
    client: FederationClient,
    runtime: ClientRuntime,
    say: Callable[[str], None],
    *,
    wait_s: float = 0.0,
    stop: threading.Event | None = None,
) -> None:
    """Tell the contributor what became of earlier submissions once their rounds closed."""
    import time

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
