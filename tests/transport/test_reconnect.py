"""The client's `Link` across outages, over real gRPC on 127.0.0.1 against real intake.

Dropped connections are real where they can be placed: the server is stopped and a new one
started on the same port. Where the drop must land at one exact point of a call (after the
coordinator committed an upload, before it answered), a gRPC client interceptor fails the call
there, as a broken connection would.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from wire import Wire, build_wire, config_of

from zoo_gym.client.link import Link
from zoo_gym.client.runtime import signed_reply
from zoo_gym.core.identity import Identity
from zoo_gym.proto.v1 import federation_pb2_grpc as pb_grpc
from zoo_gym.transport.client import FederationClient, TransportError
from zoo_gym.transport.server import start_server


@pytest.fixture
def wire(tiny_home: Path) -> Iterator[Wire]:
    built = build_wire(tiny_home)
    yield built
    built.close()


class Dropped(grpc.RpcError):
    """What gRPC raises when the connection breaks under a call."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "Stream removed (Socket closed)"


class DropFirstSubmit(grpc.StreamUnaryClientInterceptor):  # type: ignore[misc]
    """Breaks the first upload: after the server answered it (`landed`) or before it is sent."""

    def __init__(self, *, landed: bool) -> None:
        self.landed = landed
        self.submits = 0

    def intercept_stream_unary(
        self, continuation: Callable[..., Any], details: Any, requests: Iterator[Any]
    ) -> Any:
        if details.method.endswith("/SubmitUpdate"):
            self.submits += 1
            if self.submits == 1:
                if self.landed:
                    continuation(details, requests).result()
                raise Dropped()
        return continuation(details, requests)


def joined(
    wire: Wire,
    me: Identity,
    said: list[str],
    *,
    reconnect_for_s: float = 30.0,
    stop: threading.Event | None = None,
) -> tuple[FederationClient, Link]:
    client = wire.client(me)
    link = Link(client, "me", reconnect_for_s=reconnect_for_s, stop=stop, say=said.append)
    link.register()
    return client, link


def reply_for(wire: Wire, me: Identity, client: FederationClient) -> tuple[Any, Any]:
    task = client.poll(2.0)
    assert task is not None
    reply = signed_reply(
        me, task.message, config_of(task), wire.payload(task), {"num_examples": 1.0}
    )
    return task, reply


def restart_server(wire: Wire, after_s: float) -> threading.Thread:
    """Stop the coordinator's gRPC server now and serve the same backend on the same port later."""
    port = wire.server.port
    wire.server.stop(0)

    def start() -> None:
        wire.server = start_server(
            wire.co.backend,
            wire.mailbox,
            address=f"127.0.0.1:{port}",
            spool=wire.co.config.home / "spool",
        )

    timer = threading.Timer(after_s, start)
    timer.start()
    return timer


@pytest.mark.parametrize("landed", [True, False], ids=["ack-lost", "upload-lost"])
def test_an_interrupted_upload_is_settled_with_exactly_one_submission(
    wire: Wire, landed: bool
) -> None:
    # Prepare: an open round; the first upload's connection breaks after or before the server got it
    me, said = Identity.generate(), []
    client, link = joined(wire, me, said)
    wire.open_round(1, [me])
    task, reply = reply_for(wire, me, client)
    drop = DropFirstSubmit(landed=landed)
    client.stub = pb_grpc.FederationStub(grpc.intercept_channel(client.channel, drop))

    # Execute
    result = link.submit(task, reply)

    # Assert: accepted once; an update that landed is not uploaded again, a lost one is
    assert result is not None and result.accepted
    assert wire.rows(me) == [(1, "accepted", "accepted at intake")]
    assert drop.submits == (1 if landed else 2)
    assert said[0].startswith("lost the coordinator (cannot reach the coordinator at")
    assert said[1] == f"reconnected to {wire.address}"
    assert ("round 1: the update had landed before the connection dropped" in said) == landed


def test_a_poll_rides_out_a_coordinator_restart(wire: Wire) -> None:
    # Prepare: a registered contributor; the coordinator goes away and is back 2 s later with a task
    me, said = Identity.generate(), []
    client, link = joined(wire, me, said)
    timer = restart_server(wire, after_s=2.0)
    wire.open_round(1, [me])

    # Execute
    task = link.call(lambda: client.poll(1.0))
    timer.join()

    # Assert
    assert task is not None and task.round == 1
    assert said[0].startswith("lost the coordinator (cannot reach the coordinator at")
    assert said[-1] == f"reconnected to {wire.address}"


def test_a_refusal_after_an_outage_is_a_rejection_not_an_error(wire: Wire) -> None:
    # Prepare: the upload is lost and, while the contributor is away, the round closes
    me, said = Identity.generate(), []
    client, link = joined(wire, me, said)
    wire.open_round(1, [me])
    task, reply = reply_for(wire, me, client)
    wire.mailbox.withdraw({task.message.metadata.message_id})  # the round's deadline passed
    client.stub = pb_grpc.FederationStub(
        grpc.intercept_channel(client.channel, DropFirstSubmit(landed=False))
    )

    # Execute
    result = link.submit(task, reply)

    # Assert: the contributor hears why and goes on; the ledger holds the refusal
    assert result is not None and not result.accepted
    assert result.reason.startswith(f"no open task {task.message.metadata.message_id[:12]!r}")
    assert [(r, d) for r, d, _ in wire.rows(me)] == [(1, "rejected")]


def test_the_link_gives_up_after_reconnect_for_s_in_one_line(wire: Wire) -> None:
    me, said = Identity.generate(), []
    client, link = joined(wire, me, said, reconnect_for_s=1.5)
    wire.server.stop(0)

    with pytest.raises(TransportError) as raised:
        link.call(lambda: client.poll(0.1))

    message = str(raised.value)
    assert "\n" not in message and not raised.value.transient
    assert message.startswith("gave up after 1.5 s: cannot reach the coordinator at")
    assert message.endswith("raise reconnect_for_s")


def test_a_coordinator_back_with_another_key_is_refused(wire: Wire) -> None:
    # Prepare: the link registered with a coordinator that signed with another key
    me, said = Identity.generate(), []
    client, link = joined(wire, me, said)
    assert link.registration is not None
    link.registration = dataclasses.replace(
        link.registration, coordinator_key=Identity.generate().public_key
    )
    timer = restart_server(wire, after_s=0.5)

    with pytest.raises(TransportError, match="came back signing with a different key"):
        link.call(lambda: client.poll(0.1))
    timer.join()


def test_stopping_during_an_outage_returns_at_once(wire: Wire) -> None:
    me, said = Identity.generate(), []
    stop = threading.Event()
    client, link = joined(wire, me, said, stop=stop)
    wire.server.stop(0)
    threading.Timer(0.5, stop.set).start()

    assert link.call(lambda: client.poll(0.1)) is None
    assert len(said) == 1
