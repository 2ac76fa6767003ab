"""The gRPC service's limits: the accounting itself, then over real gRPC on 127.0.0.1.

The accounting (`CallGate`, `WorkerShares`) is checked by hand against its documented order.
Over the wire: deadlines for a silent upload, a contributor's long polls replacing each other,
a busy coordinator ridden out by the client's `Link`, and which refusals of a signed submission
become ledger rows (decisions) and which do not (a broken transmission).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from wire import Wire, build_wire, config_of

from zoo_gym.client.link import Link
from zoo_gym.client.runtime import signed_reply
from zoo_gym.core.identity import Identity
from zoo_gym.transport.limits import (
    Admission,
    CallGate,
    RateLimits,
    RefusalPacer,
    Refused,
    WorkerShares,
    peer_key,
)

# -- accounting -------------------------------------------------------------------------------


def gate(**limits: float) -> CallGate:
    now = [0.0]
    return CallGate(RateLimits(**limits), clock=lambda: now[0])  # type: ignore[arg-type]


def test_limits_are_checked_in_order_and_each_refusal_says_when_to_retry() -> None:
    g = gate(max_open_calls=3, max_concurrent_per_peer=2, max_unauthenticated_per_peer=1)
    first = g.admit("10.0.0.1")
    with pytest.raises(Refused, match=r"^10\.0\.0\.1 has 1 calls that have not signed in"):
        g.admit("10.0.0.1")  # the address's open calls are fine; its anonymous ones are not
    g.sign_in(first, "alice")
    second = g.admit("10.0.0.1")
    with pytest.raises(Refused, match=r"^10\.0\.0\.1 already has 2 calls open .* retry in 5 s$"):
        g.admit("10.0.0.1")
    g.admit("10.0.0.2")
    with pytest.raises(Refused, match=r"^the coordinator has 3 calls open \(its limit\)"):
        g.admit("10.0.0.3")

    g.close(second)
    g.close(second)  # idempotent
    assert (g.open_calls, g.unauthenticated, dict(g.per_peer)) == (
        2,
        1,
        {"10.0.0.1": 1, "10.0.0.2": 1},
    )


def test_anonymous_calls_are_bounded_in_total_and_signed_in_ones_per_contributor() -> None:
    g = gate(max_unauthenticated_calls=2, max_calls_per_contributor=2)
    a, b = g.admit("10.0.0.1"), g.admit("10.0.0.2")
    with pytest.raises(Refused, match=r"^2 calls are waiting to sign in \(the limit\)"):
        g.admit("10.0.0.3")
    g.sign_in(a, "alice")
    g.sign_in(b, "alice")
    c = g.admit("10.0.0.3")  # signing in freed the anonymous slots
    with pytest.raises(Refused, match=r"^contributor alice already has 2 calls open"):
        g.sign_in(c, "alice")
    g.close(c)  # a refused sign-in is not counted under the contributor
    assert (g.unauthenticated, dict(g.per_contributor)) == (0, {"alice": 2})
    for call in (a, b):
        g.close(call)
    assert (g.open_calls, dict(g.per_peer), dict(g.per_contributor)) == (0, {}, {})


def test_address_and_contributor_rates_are_separate_buckets() -> None:
    g = gate(peer_rate_per_s=1, peer_burst=2, contributor_rate_per_s=1, contributor_burst=1)
    calls = [g.admit("10.0.0.1") for _ in range(2)]
    with pytest.raises(Refused, match=r"^too many requests from 10\.0\.0\.1 \(1/s allowed\)"):
        g.admit("10.0.0.1")
    g.sign_in(calls[0], "bob")
    with pytest.raises(Refused, match=r"too many requests from contributor bob .* retry in 1\.0 s"):
        g.sign_in(calls[1], "bob")


def test_ipv6_callers_are_counted_by_their_64_prefix() -> None:
    assert peer_key("ipv4:203.0.113.9:5555") == "203.0.113.9"
    assert peer_key("ipv6:[2001:db8:1:2:aaaa::1]:443") == "2001:db8:1:2::/64"
    assert peer_key("ipv6:[2001:db8:1:2:bbbb::7]:443") == "2001:db8:1:2::/64"
    assert peer_key("ipv6:[::ffff:198.51.100.4]:80") == "198.51.100.4"
    assert peer_key("unix:/tmp/socket") == "unix:/tmp/socket"


def test_one_address_cannot_take_the_whole_worker_pool() -> None:
    release = threading.Event()
    running: dict[str, int] = {"a": 0, "b": 0}
    most = {"a": 0, "b": 0}
    lock = threading.Lock()

    def job(who: str) -> str:
        with lock:
            running[who] += 1
            most[who] = max(most[who], running[who])
        release.wait(10)
        with lock:
            running[who] -= 1
        return who

    async def scenario() -> list[str]:
        with ThreadPoolExecutor(4) as pool:
            shares = WorkerShares(pool, workers=4, per_peer=2, per_contributor=1)
            flood = [shares.run(Admission("a"), lambda: job("a")) for _ in range(6)]
            tasks = [asyncio.ensure_future(f) for f in flood]
            await asyncio.sleep(0.2)
            other = asyncio.ensure_future(shares.run(Admission("b"), lambda: job("b")))
            await asyncio.sleep(0.2)
            b_ran = running["b"] == 1  # "b" got a worker although "a" queued six jobs
            release.set()
            done = await asyncio.gather(*tasks, other)
            assert b_ran
            return done

    assert sorted(asyncio.run(scenario())) == ["a"] * 6 + ["b"]
    assert most == {"a": 2, "b": 1}


# -- over the wire -----------------------------------------------------------------------------


@pytest.fixture
def wire(tiny_home: Path) -> Iterator[Wire]:
    built = build_wire(
        tiny_home,
        limits=RateLimits(first_message_timeout_s=1.0, upload_idle_timeout_s=1.0),
    )
    yield built
    built.close()


def test_an_upload_that_stops_sending_is_ended_and_not_recorded(wire: Wire) -> None:
    # Prepare: a signed header, then silence
    me = Identity.generate()
    client, task = wire.handed_task(me)
    reply = signed_reply(me, task.message, config_of(task), wire.payload(task), {})
    sent: list[object] = []
    original = client.stub.SubmitUpdate

    def stall(chunks, **kw):  # type: ignore[no-untyped-def]
        def slow() -> Iterator[object]:
            first = next(chunks)
            sent.append(first)
            yield first
            time.sleep(3.0)  # longer than upload_idle_timeout_s

        return original(slow(), **kw)

    client.stub.SubmitUpdate = stall  # type: ignore[method-assign]

    # Execute
    with pytest.raises(Exception, match=r"no upload data for 1 s; the upload was dropped"):
        client.submit(task, reply)

    # Assert: a transport failure, not a decision; nothing half-written is kept
    assert wire.rows(me) == []
    assert not list(wire.co.config.path("spool").glob("*.part"))


def test_a_newer_long_poll_replaces_the_older_one(wire: Wire) -> None:
    # Prepare: one contributor opens 34 long polls at once
    me = Identity.generate()
    poller = wire.client(me)
    poller.register("poller")
    results: list[object] = []
    threads = [threading.Thread(target=lambda: results.append(poller.poll(5.0))) for _ in range(34)]
    started = time.monotonic()
    for t in threads:
        t.start()
    time.sleep(1.0)

    # Execute: meanwhile another contributor registers and polls
    other = wire.client()
    other.register("other")
    assert other.poll(0.1) is None

    # Assert: all but the newest poll answered idle at once; the newest one waited its 5 s
    answered_early = len(results)
    for t in threads:
        t.join(timeout=15)
    assert answered_early >= 33 - 4  # all but the newest (and a few refused at the limit)
    assert len(results) == 34 and all(r is None for r in results)
    assert time.monotonic() - started >= 4.5
    assert wire.server.port  # still serving


def test_the_link_waits_while_the_coordinator_is_busy(tiny_home: Path) -> None:
    # Prepare: an address may make one call per 2 s; the first one is spent
    wire = build_wire(tiny_home, limits=RateLimits(peer_rate_per_s=0.5, peer_burst=1))
    try:
        said: list[str] = []
        spent = wire.client()
        spent.register("spent")
        link = Link(wire.client(), "me", reconnect_for_s=20, say=said.append)

        # Execute: first contact is refused as busy, and tried again
        started = time.monotonic()
        registration = link.register()

        # Assert
        assert registration.status == "active"
        assert time.monotonic() - started >= 1.0
        assert (
            said
            and "is busy (too many requests from 127.0.0.1 (0.5/s allowed); retry in" in (said[0])
        )
    finally:
        wire.close()


def test_refusals_of_a_signed_submission_are_recorded_and_broken_uploads_are_not(
    wire: Wire,
) -> None:
    me = Identity.generate()
    client, task = wire.handed_task(me)
    original = client.stub.SubmitUpdate

    def send(edit):  # type: ignore[no-untyped-def]
        def edited(chunks, **kw):  # type: ignore[no-untyped-def]
            return original(iter(edit(list(chunks))), **kw)

        client.stub.SubmitUpdate = edited  # type: ignore[method-assign]
        reply = signed_reply(me, task.message, config_of(task), wire.payload(task), {})
        try:
            return client.submit(task, reply)
        finally:
            client.stub.SubmitUpdate = original  # type: ignore[method-assign]

    def garbled_reply(items):  # type: ignore[no-untyped-def]
        items[0].header.flower_reply = b"\xffnot a message"
        return items

    def truncated(items):  # type: ignore[no-untyped-def]
        return items[:-1]

    def other_bytes(items):  # type: ignore[no-untyped-def]
        items[-1].data = bytes([items[-1].data[0] ^ 1]) + items[-1].data[1:]
        return items

    # Execute + Assert: an unreadable header is refused, and recorded
    with pytest.raises(Exception, match="flower_reply is not a serialised Flower Message"):
        send(garbled_reply)
    # a truncated upload is a broken transmission: refused, not recorded
    with pytest.raises(Exception, match="truncated"):
        send(truncated)
    # a complete upload whose bytes are not the signed ones is refused, and recorded
    result = send(other_bytes)
    assert not result.accepted and "SHA-256 differs from the signed statement" in result.reason

    rows = wire.rows(me)
    assert [d for _, d, _ in rows] == ["rejected", "rejected"]
    assert "flower_reply" in rows[0][2] and "SHA-256 differs" in rows[1][2]


def test_grpc_errors_of_the_limits_are_one_line(wire: Wire) -> None:
    channel = grpc.insecure_channel(wire.address)
    try:
        call = channel.stream_unary("/zoo_gym.v1.Federation/GetOutcome")

        def nothing() -> Iterator[bytes]:
            time.sleep(2.0)
            return
            yield b""

        with pytest.raises(grpc.RpcError) as err:
            call(nothing(), timeout=10)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED  # type: ignore[attr-defined]
        assert err.value.details() == (  # type: ignore[attr-defined]
            "no request arrived within 1 s of opening the call; send it at once"
        )
    finally:
        channel.close()


def test_refusals_wait_the_delay_up_to_a_bound() -> None:
    async def scenario() -> tuple[float, float, int]:
        pacer = RefusalPacer(0.3, max_waiting=2)
        began = time.monotonic()
        held = [asyncio.create_task(pacer.pause()) for _ in range(2)]
        await asyncio.sleep(0)
        waiting = pacer.waiting
        await pacer.pause()  # a third finds the bound full: answered at once
        at_once = time.monotonic() - began
        await asyncio.gather(*held)
        return at_once, time.monotonic() - began, waiting

    at_once, held_for, waiting = asyncio.run(scenario())
    assert waiting == 2
    assert at_once < 0.1 <= 0.3 <= held_for


def test_a_flood_over_the_rate_is_answered_one_refusal_per_delay(tiny_home: Path) -> None:
    # Prepare: the default refusal delay; an address may make one call per 100 s
    limits = RateLimits(peer_rate_per_s=0.01, peer_burst=1)
    assert limits.refusal_delay_s == 1.0
    wire = build_wire(tiny_home, limits=limits)
    try:
        client = wire.client()
        client.register("spent")

        # Execute: ask again and again, each time as soon as answered, for 2.5 s
        codes: list[str] = []
        began = time.monotonic()
        while time.monotonic() - began < 2.5:
            try:
                client.register("again")
            except Exception as exc:
                codes.append(getattr(exc, "code", type(exc).__name__))

        # Assert: three refusals at most, each after the delay
        assert codes and set(codes) == {"RESOURCE_EXHAUSTED"}
        assert len(codes) <= 3
    finally:
        wire.close()
