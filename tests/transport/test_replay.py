"""A signed call is good once: replays of captured calls are refused over real gRPC on 127.0.0.1.

Every call of a contributor carries a fresh nonce inside its signed statement; the coordinator
accepts each (contributor, nonce) once for as long as the call's timestamp could pass the clock
check. The server runs with start_server's default limits.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from wire import Wire, build_wire

from zoo_gym.coordinator.replay import MARGIN_S, NonceCache
from zoo_gym.core.identity import Identity
from zoo_gym.core.protocol import request_statement
from zoo_gym.proto.v1 import federation_pb2 as pb
from zoo_gym.proto.v1 import federation_pb2_grpc as pb_grpc
from zoo_gym.transport.client import FederationClient

UPGRADE = "this client does not send per-call nonces; upgrade zoo-gym"


class Recorder(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):  # type: ignore[misc]
    """Keeps the last request of every method a client sends: what an eavesdropper captures."""

    def __init__(self) -> None:
        self.sent: dict[str, Any] = {}

    def _keep(self, details: grpc.ClientCallDetails, request: Any) -> None:
        method = details.method
        self.sent[method.decode() if isinstance(method, bytes) else method] = request

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        self._keep(details, request)
        return continuation(details, request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        self._keep(details, request)
        return continuation(details, request)


@pytest.fixture
def wire(tiny_home: Path) -> Iterator[Wire]:
    built = build_wire(tiny_home, limits=None)
    yield built
    built.close()


def recorded(wire: Wire, me: Identity) -> tuple[FederationClient, Recorder]:
    client = wire.client(me)
    recorder = Recorder()
    client.stub = pb_grpc.FederationStub(grpc.intercept_channel(client.channel, recorder))
    return client, recorder


def replay(stub: pb_grpc.FederationStub, method: str, request: Any) -> grpc.RpcError | None:
    """Send a captured request again; the error it got, or None when it was served."""
    call = getattr(stub, method.rsplit("/", 1)[1])
    try:
        reply = call(request, timeout=10)
        if method.endswith("DownloadFile"):
            list(reply)
    except grpc.RpcError as err:
        return err
    return None


def raw_auth(
    me: Identity, method: str, digest: str, nonce: bytes, signer: Identity | None = None
) -> pb.Auth:
    ts = int(time.time() * 1000)
    cid = me.contributor_id
    statement = request_statement(method, cid, ts, nonce, digest)
    return pb.Auth(
        contributor_id=cid, timestamp_ms=ts, nonce=nonce, signature=(signer or me).sign(statement)
    )


def test_the_request_statement_bytes_are_pinned() -> None:
    statement = request_statement(
        "download", "ab" * 16, 1_700_000_000_123, b"\x00\x01" * 8, "v0001/model.safetensors"
    )

    assert statement == (
        b"zoo-gym/request/v2|download|abababababababababababababababab|1700000000123|"
        b"00010001000100010001000100010001|v0001/model.safetensors"
    )


def test_captured_poll_manifest_download_and_outcome_calls_are_refused_when_replayed(
    wire: Wire, tmp_path: Path
) -> None:
    me = Identity.generate()
    client, recorder = recorded(wire, me)
    client.register("me")
    wire.open_round(1, [me])
    assert client.poll(2.0) is not None
    client.fetch_model("v0000", tmp_path / "v0000", client.coordinator_key)
    assert client.outcome(1).decision in ("none", "pending")
    captured = {m: r for m, r in recorder.sent.items() if not m.endswith("Register")}
    eavesdropper = pb_grpc.FederationStub(grpc.insecure_channel(wire.address))

    refusals = {m.rsplit("/", 1)[1]: replay(eavesdropper, m, r) for m, r in captured.items()}

    assert set(refusals) == {"PollTask", "GetManifest", "DownloadFile", "GetOutcome"}
    for method, err in refusals.items():
        assert err is not None, f"a replayed {method} was served"
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED, method
        assert err.details().startswith("replayed request: "), err.details()
    # the honest client's own fresh calls go on working
    assert client.outcome(1).decision in ("none", "pending")
    client.fetch_model("v0000", tmp_path / "again", client.coordinator_key)


def test_a_call_without_a_nonce_is_refused_with_the_upgrade_line(wire: Wire) -> None:
    me = Identity.generate()
    client = wire.client(me)
    client.register("me")
    ts = int(time.time() * 1000)
    cid = me.contributor_id
    # what a client of the previous protocol sends: no nonce, version-1 statement
    old = pb.Auth(
        contributor_id=cid,
        timestamp_ms=ts,
        signature=me.sign(f"zoo-gym/v1|outcome|{cid}|{ts}|1".encode()),
    )

    with pytest.raises(grpc.RpcError) as refused:
        client.stub.GetOutcome(pb.OutcomeRequest(auth=old, round=1), timeout=10)

    short = raw_auth(me, "outcome", "1", b"1234")
    with pytest.raises(grpc.RpcError) as too_short:
        client.stub.GetOutcome(pb.OutcomeRequest(auth=short, round=1), timeout=10)

    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert refused.value.details() == UPGRADE
    assert "nonce must be 16 random bytes, not 4" in too_short.value.details()
    assert client.outcome(1).decision == "none"


def test_only_a_verified_call_spends_its_nonce(wire: Wire) -> None:
    me, other = Identity.generate(), Identity.generate()
    client = wire.client(me)
    client.register("me")
    wire.client(other).register("other")
    nonce = os.urandom(16)

    def outcome(auth: pb.Auth) -> grpc.RpcError | None:
        return replay(
            client.stub, "/zoo_gym.v1.Federation/GetOutcome", pb.OutcomeRequest(auth=auth, round=1)
        )

    forged = outcome(raw_auth(me, "outcome", "1", nonce, signer=other))
    honest = outcome(raw_auth(me, "outcome", "1", nonce))
    someone_else = outcome(raw_auth(other, "outcome", "1", nonce))
    again = outcome(raw_auth(me, "outcome", "1", nonce))

    assert forged is not None and "signature does not match" in forged.details()
    assert honest is None  # the forged call with that nonce did not use it up
    assert someone_else is None  # nonces are per contributor
    assert again is not None and again.details().startswith("replayed request: ")


def test_a_call_replayed_concurrently_is_served_once(wire: Wire) -> None:
    me = Identity.generate()
    wire.client(me).register("me")
    request = pb.OutcomeRequest(auth=raw_auth(me, "outcome", "1", os.urandom(16)), round=1)
    stubs = [pb_grpc.FederationStub(grpc.insecure_channel(wire.address)) for _ in range(8)]
    results: list[grpc.RpcError | None] = []
    start = threading.Barrier(len(stubs))

    def send(stub: pb_grpc.FederationStub) -> None:
        start.wait()
        results.append(replay(stub, "/zoo_gym.v1.Federation/GetOutcome", request))

    threads = [threading.Thread(target=send, args=(s,)) for s in stubs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)

    assert len(results) == 8
    assert results.count(None) == 1
    assert all(r is None or r.details().startswith("replayed request: ") for r in results)


def test_the_nonce_cache_stays_within_its_bounds_on_the_wire(wire: Wire) -> None:
    cache = NonceCache(wire.co.backend.clock_skew_s, per_contributor=4, max_entries=10)
    wire.co.backend.nonces = cache
    parties = [recorded(wire, Identity.generate()) for _ in range(4)]
    first: list[tuple[FederationClient, Any]] = []
    for client, recorder in parties:
        client.register("me")
        client.outcome(1)
        first.append((client, recorder.sent["/zoo_gym.v1.Federation/GetOutcome"]))
    sizes = []
    for _ in range(6):
        for client, _ in parties:
            client.outcome(1)
            sizes.append(len(cache))

    refused = [replay(c.stub, "/zoo_gym.v1.Federation/GetOutcome", r) for c, r in first]

    assert max(sizes) <= 10
    assert all(e is not None and e.details().startswith("replayed request: ") for e in refused)
    assert parties[0][0].outcome(1).decision == "none"  # fresh calls still pass


# -- the cache itself, on a hand-driven clock ----------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def admit_all(cache: NonceCache, contributor: str, stamps: range) -> list[bool]:
    return [cache.admit(contributor, n.to_bytes(16, "big"), n) for n in stamps]


def test_a_nonce_is_remembered_for_the_whole_window_then_forgotten() -> None:
    clock = Clock()
    cache = NonceCache(300.0, clock=clock)
    assert cache.admit("a", b"n" * 16, 1)

    clock.now += 600.0  # a timestamp passes the clock check for 2 x 300 s of coordinator time
    replayed_late = cache.admit("a", b"n" * 16, 1)
    clock.now += MARGIN_S + 0.1
    cache.admit("b", b"x" * 16, 2)  # any call sweeps what expired

    assert not replayed_late
    assert len(cache) == 1


def test_the_per_contributor_cap_evicts_oldest_without_reopening_replays() -> None:
    cache = NonceCache(300.0, per_contributor=5, max_entries=100, clock=Clock())

    admitted = admit_all(cache, "a", range(1, 21))
    evicted_replayed = cache.admit("a", (3).to_bytes(16, "big"), 3)
    newer = cache.admit("a", b"fresh-nonce-0000", 21)
    others = cache.admit("b", (3).to_bytes(16, "big"), 3)

    assert all(admitted)
    assert not evicted_replayed  # older than the newest evicted call: cannot be told apart
    assert newer and others
    assert len(cache) == 6


def test_the_global_cap_holds_against_many_contributors() -> None:
    cache = NonceCache(300.0, per_contributor=50, max_entries=40, clock=Clock())

    for who in range(30):
        assert all(admit_all(cache, f"c{who}", range(1, 11)))
    replays = [cache.admit(f"c{who}", (1).to_bytes(16, "big"), 1) for who in range(30)]

    assert len(cache) == 40
    assert not any(replays)


def test_concurrent_admissions_of_one_nonce_let_exactly_one_through() -> None:
    cache = NonceCache(300.0, per_contributor=10_000, max_entries=10_000)
    results: list[bool] = []
    start = threading.Barrier(8)

    def run(worker: int) -> None:
        start.wait()
        for n in range(500):
            results.append(cache.admit("a", n.to_bytes(16, "big"), n))
            cache.admit("a", f"{worker}-{n}".encode().ljust(16, b"."), n)

    threads: list[threading.Thread] = [threading.Thread(target=run, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    assert results.count(True) == 500
    assert len(cache) == 500 + 8 * 500
