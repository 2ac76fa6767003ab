"""Contributor identity, replay and limits, over real gRPC on 127.0.0.1 against real intake.

Each refusal is checked three ways: the status and one-line message the caller gets, the row the
ledger keeps (decision and reason), and what the contributor reads back with `GetOutcome`.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from sqlmodel import Session
from wire import Wire, build_wire, config_of, take_task

from zoo_gym import ledger
from zoo_gym.client.runtime import signed_reply
from zoo_gym.compression import CodecSpec, encode
from zoo_gym.core.identity import Identity
from zoo_gym.core.protocol import SignedSubmission
from zoo_gym.proto.v1 import federation_pb2 as pb
from zoo_gym.transport.client import TransportError
from zoo_gym.transport.limits import RateLimits, TokenBuckets, peer_host


@pytest.fixture
def wire(tiny_home: Path) -> Iterator[Wire]:
    built = build_wire(tiny_home, settings="max_upload_bytes = 65536")
    yield built
    built.close()


def test_a_reused_nonce_is_refused_as_a_replay(wire: Wire) -> None:
    me = Identity.generate()
    client, task = wire.handed_task(me)
    config = config_of(task)
    first = signed_reply(me, task.message, config, b"x" * 70_000, {})
    with pytest.raises(TransportError, match="exceeds the 65536-byte limit"):
        client.submit(task, first)  # refused before the payload is read: the task stays open

    # the same nonce, now on a valid payload (a captured statement re-signed or replayed)
    nonce = SignedSubmission.from_record(first.content.config_records["submission"]).nonce
    second = signed_reply(me, task.message, config, wire.payload(task), {"num_examples": 1.0})
    record = second.content.config_records["submission"]
    statement = dataclasses.replace(SignedSubmission.from_record(record), nonce=nonce).signed(me)
    record.update(statement.to_record())
    result = client.submit(task, second)

    assert not result.accepted and "nonce was already used (a replay)" in result.reason
    assert [d for _, d, _ in wire.rows(me)] == ["rejected"]  # the replay adds no row


def test_a_captured_accepted_upload_replayed_verbatim_is_refused(wire: Wire) -> None:
    me = Identity.generate()
    client, task = wire.handed_task(me)
    reply = signed_reply(
        me, task.message, config_of(task), wire.payload(task), {"num_examples": 1.0}
    )
    sent: list[object] = []
    original = client.stub.SubmitUpdate

    def capture(chunks, **kw):  # type: ignore[no-untyped-def]
        items = list(chunks)
        sent.extend(items)
        return original(iter(items), **kw)

    client.stub.SubmitUpdate = capture  # type: ignore[method-assign]
    assert client.submit(task, reply).accepted

    with pytest.raises(grpc.RpcError) as replayed:
        original(iter(sent), timeout=10)

    # the call's own nonce is spent: refused before the task or the ledger is looked at
    assert replayed.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "replayed request" in replayed.value.details()
    assert [d for _, d, _ in wire.rows(me)] == ["accepted"]


def test_cross_round_and_reordered_submissions_are_refused(wire: Wire) -> None:
    me = Identity.generate()
    client = wire.client(me)
    client.register("me")
    wire.open_round(1, [me])
    old = take_task(client)
    old_reply = signed_reply(
        me, old.message, config_of(old), wire.payload(old), {"num_examples": 1.0}
    )
    wire.mailbox.withdraw({old.message.metadata.message_id})  # round 1 ends without this reply
    wire.open_round(2, [me])
    task = take_task(client)

    # round 1's signed update sent for round 1's task after round 2 opened
    with pytest.raises(TransportError, match=r"no open task .* \(round 1 is closed"):
        client.submit(old, old_reply)
    # round 1's statement on round 2's task: the signature names round 1
    stale = signed_reply(
        me, task.message, dataclasses.replace(config_of(task), round=1), wire.payload(task), {}
    )
    result = client.submit(task, stale)
    assert not result.accepted and "stale round" in result.reason
    # a statement whose round is changed on the way (reordered into round 2) no longer verifies
    wire.open_round(3, [me])
    task = take_task(client)
    tampered = signed_reply(
        me, task.message, dataclasses.replace(config_of(task), round=2), wire.payload(task), {}
    )
    tampered.content.config_records["submission"]["round"] = 3
    result = client.submit(task, tampered)
    assert not result.accepted and "signature does not match your key" in result.reason

    rows = wire.rows(me)
    assert [(r, d) for r, d, _ in rows] == [
        (1, "rejected"),
        (1, "rejected"),
        (3, "rejected"),
    ]  # filed under the round each statement names
    assert "no open task" in rows[0][2] and "stale round" in rows[1][2]
    seen = client.outcome(3)
    assert seen.decision == "rejected" and "signature does not match" in seen.reason


def test_banned_and_unregistered_keys_are_refused(wire: Wire) -> None:
    stranger = wire.client()
    with pytest.raises(TransportError, match="not registered here; run `gym-client join`"):
        stranger.poll(0.1)
    me = Identity.generate()
    client = wire.client(me)
    client.register("me")
    with Session(wire.co.engine) as s:
        ledger.set_contributor_status(
            s,
            contributor_id=me.contributor_id,
            status="banned",
            reason="sent sign-flipped updates",
            actor="apikey:ops",
        )

    with pytest.raises(
        TransportError, match=r"this key is banned \(sent sign-flipped updates\)"
    ) as err:
        client.poll(0.1)
    assert err.value.code == "PERMISSION_DENIED"
    assert client.register("me").status == "banned"


def test_approval_mode_holds_new_keys_until_an_operator_approves(wire: Wire) -> None:
    wire.co.backend.require_approval = True
    me = Identity.generate()
    client = wire.client(me)
    assert client.register("me").status == "pending"
    with pytest.raises(TransportError, match="awaits operator approval"):
        client.poll(0.1)

    with Session(wire.co.engine) as s:
        ledger.set_contributor_status(
            s, contributor_id=me.contributor_id, status="active", reason="", actor="apikey:ops"
        )

    assert client.poll(0.1) is None  # admitted: an idle answer, no refusal


def test_an_envelope_claiming_more_elements_than_the_round_is_refused(wire: Wire) -> None:
    me = Identity.generate()
    client, task = wire.handed_task(me)
    first = wire.layout[0]
    # right names, a first tensor 40x the allowed size, sent with the 1-bit codec so it fits the upload limit
    delta = {s.name: torch.zeros(s.shape) for s in wire.layout}
    delta[first.name] = torch.ones(first.shape[0], first.shape[1] * 40 * len(wire.layout))
    payload = encode(delta, CodecSpec("bitdelta", 128))
    result = client.submit(task, signed_reply(me, task.message, config_of(task), payload, {}))

    assert (
        not result.accepted
        and "update envelope is invalid" in result.reason
        and "more than max_elements" in result.reason
    )


def test_submissions_per_round_are_capped_and_the_cap_is_recorded_once(wire: Wire) -> None:
    me = Identity.generate()
    client, task = wire.handed_task(me)
    errors = []
    for _ in range(5):  # oversized: refused before the payload, so the task stays open
        with pytest.raises(TransportError) as err:
            client.submit(task, signed_reply(me, task.message, config_of(task), b"x" * 70_000, {}))
        errors.append(str(err.value))
    result = client.submit(
        task, signed_reply(me, task.message, config_of(task), wire.payload(task), {})
    )

    assert all("exceeds the 65536-byte limit" in e for e in errors)
    rows = wire.rows(me)
    assert [d for _, d, _ in rows] == ["rejected"] * 4  # 3 allowed + the one that hit the cap
    assert all("exceeds" in r for _, _, r in rows[:3])
    assert "more than 3 submissions from you for round 1" in rows[3][2]
    assert not result.accepted and "more than 3 submissions" in result.reason
    assert "more than 3 submissions" in client.outcome(1).reason


def test_peer_request_rate_is_limited(tiny_home: Path) -> None:
    wire = build_wire(
        tiny_home,
        limits=RateLimits(
            peer_rate_per_s=1,
            peer_burst=5,
            contributor_rate_per_s=0,
            contributor_burst=1,
            max_concurrent_per_peer=0,
        ),
    )
    try:
        client = wire.client()
        client.register("a")
        for _ in range(4):
            client.register("a")
        with pytest.raises(
            TransportError, match=r"too many requests from 127\.0\.0\.1 \(1/s allowed\); retry in"
        ) as err:
            client.register("a")
        assert err.value.code == "RESOURCE_EXHAUSTED"
        time.sleep(1.1)
        client.register("a")  # a token refilled
    finally:
        wire.close()


def test_contributor_request_rate_is_limited_per_key(tiny_home: Path) -> None:
    wire = build_wire(
        tiny_home,
        limits=RateLimits(
            peer_rate_per_s=0,
            peer_burst=1,
            contributor_rate_per_s=0.5,
            contributor_burst=3,
            max_concurrent_per_peer=0,
        ),
    )
    try:
        busy, other = wire.client(), wire.client()
        busy.register("busy")
        other.register("other")
        for _ in range(3):
            busy.poll(0.0)
        with pytest.raises(
            TransportError, match=r"too many requests from contributor .* \(0\.5/s allowed\)"
        ):
            busy.poll(0.0)
        assert other.poll(0.0) is None  # another key keeps its own allowance
    finally:
        wire.close()


def test_open_calls_per_peer_are_limited(tiny_home: Path) -> None:
    wire = build_wire(
        tiny_home,
        limits=RateLimits(
            peer_rate_per_s=0,
            peer_burst=1,
            contributor_rate_per_s=0,
            contributor_burst=1,
            max_concurrent_per_peer=2,
        ),
    )
    try:
        clients = [wire.client() for _ in range(3)]
        for c in clients:
            c.register("c")
        polls = [threading.Thread(target=c.poll, args=(3.0,)) for c in clients[:2]]
        for t in polls:
            t.start()
        time.sleep(0.5)
        with pytest.raises(TransportError, match=r"127\.0\.0\.1 already has 2 calls open"):
            clients[2].poll(0.0)
        for t in polls:
            t.join()
        assert clients[2].poll(0.0) is None
    finally:
        wire.close()


def test_token_bucket_refills_at_its_rate() -> None:
    now = [0.0]
    buckets = TokenBuckets(2.0, 3, max_keys=2, clock=lambda: now[0])
    assert [buckets.take("a") for _ in range(4)] == [0.0, 0.0, 0.0, 0.5]
    now[0] = 0.5  # one token back
    assert buckets.take("a") == 0.0 and buckets.take("a") == pytest.approx(0.5)
    buckets.take("b")
    buckets.take("c")  # evicts "a", the least recently used
    assert len(buckets._buckets) == 2 and "a" not in buckets._buckets
    assert peer_host("ipv4:127.0.0.1:5555") == "127.0.0.1" and peer_host("ipv6:[::1]:80") == "::1"


def test_strings_a_caller_chose_are_quoted_so_a_refusal_stays_one_line(wire: Wire) -> None:
    me = Identity.generate()
    client, task = wire.handed_task(me)
    forged = "v9\nINFO round 1 accepted"
    reply = signed_reply(
        me,
        task.message,
        dataclasses.replace(config_of(task), base_version=forged),
        wire.payload(task),
        {"num_examples": 1.0},
    )
    result = client.submit(task, reply)
    assert not result.accepted and "stale base" in result.reason
    assert "\n" not in result.reason and repr(forged) in result.reason

    header = pb.SubmissionHeader(
        auth=client._auth("submit", "x\ny|00"), message_id="x\ny", payload_sha256="00"
    )
    with pytest.raises(grpc.RpcError) as refused:
        client.stub.SubmitUpdate(iter([pb.UpdateChunk(header=header)]), timeout=10)
    assert refused.value.details().startswith("no open task 'x\\ny' for you")  # type: ignore[attr-defined]
    assert all("\n" not in reason for _, _, reason in wire.rows(me))


def test_a_version_that_names_a_path_outside_the_models_is_not_served(
    wire: Wire, tmp_path: Path
) -> None:
    # Prepare: a copy of a published version outside the registry's root, manifest and all
    published = wire.co.registry.latest()
    outside = tmp_path / "elsewhere" / "v9999"
    outside.parent.mkdir()
    import shutil

    shutil.copytree(published.directory, outside)
    [name, *_] = published.manifest.files
    client = wire.client()
    client.register("me")

    # Execute + Assert: as an absolute path or climbing out of models/, it is not a version
    for version in (str(outside), f"../../{outside.relative_to(tmp_path)}"):
        with pytest.raises(TransportError, match=r"is not published here"):
            client.fetch_model(version, tmp_path / "fetched", wire.co.signer.public_key)
        with pytest.raises(TransportError, match=r"is not published here"):
            client._download(version, name, tmp_path / "got")  # DownloadFile, no manifest first
    assert not list((tmp_path / "fetched").iterdir())
    assert (tmp_path / "got").read_bytes() == b""  # opened for appending; nothing came
