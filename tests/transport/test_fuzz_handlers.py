"""Fuzzing every RPC of the federation service over real gRPC on 127.0.0.1.

Hypothesis draws protobuf requests (mostly correctly signed, so they get past authentication and
reach the handler's own checks) and raw bytes that are not protobuf at all. After every call the
server must still be serving, and every failure must be a gRPC status other than UNKNOWN (which
is what an unhandled exception becomes) with a one-line message. Uploads claiming huge sizes must
be refused without the server holding them.

The server runs with start_server's default limits. A call refused for its rate is made again
after the wait the refusal names, signed anew (a signed call is good once), as a client would.

`ZOO_FUZZ_EXAMPLES` sets the examples per strategy (default 40): for a longer run,
`ZOO_FUZZ_EXAMPLES=500 .venv/bin/pytest tests/transport/test_fuzz_handlers.py -s`.
The envelope decoder is fuzzed where it lives (tests/compression).
"""

from __future__ import annotations

import hashlib
import os
import re
import resource
import shutil
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from flwr.app import Message, RecordDict
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from wire import Wire, build_wire, take_task

from zoo_gym.core.identity import Identity
from zoo_gym.core.protocol import request_statement
from zoo_gym.proto.v1 import federation_pb2 as pb
from zoo_gym.transport.client import FederationClient, ReceivedTask
from zoo_gym.transport.server import serialize_message

EXAMPLES = int(os.environ.get("ZOO_FUZZ_EXAMPLES", "40"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
METHODS = ("Register", "PollTask", "GetManifest", "DownloadFile", "SubmitUpdate", "GetOutcome")
CASES: Counter[str] = Counter()
PROBE = Identity.generate()  # registered when the wire starts: a known key answers at any rate
PACED: Counter[str] = Counter()
RETRY_IN = re.compile(r"retry in ([0-9.]+) s")
MAX_PACED = 30

u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)
i64 = st.integers(-(2**63), 2**63 - 1)
text = st.text(max_size=80)
blob = st.binary(max_size=96)


@pytest.fixture(scope="module")
def wire(tiny_home_template: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Wire]:
    home = tmp_path_factory.mktemp("fuzz") / "coordinator"
    shutil.copytree(tiny_home_template, home)
    built = build_wire(home, limits=None, settings="max_upload_bytes = 65536")
    probe = FederationClient(built.address, PROBE, timeout_s=5)
    probe.register("probe")  # known before the fuzzing spends the address's new-key allowance
    probe.close()
    yield built
    built.close()
    print("\nfuzz cases per RPC:", dict(CASES), "total", sum(CASES.values()))
    print("calls made again after a rate-limit refusal:", dict(PACED))


@pytest.fixture(scope="module")
def parties(wire: Wire) -> dict[str, tuple[Identity, FederationClient, ReceivedTask]]:
    """Two registered contributors, each holding round 1's task (poller never answers it)."""
    out = {}
    ids = {name: Identity.generate() for name in ("poller", "submitter")}
    for name, identity in ids.items():
        wire.client(identity).register(name)
    wire.open_round(1, list(ids.values()))
    for name, identity in ids.items():
        client = wire.clients[-2 if name == "poller" else -1]
        out[name] = (identity, client, take_task(client))
    return out


def auth(identity: Identity, method: str, digest: str, *, skew_ms: int = 0) -> pb.Auth:
    """A correctly signed Auth, with a fresh nonce (each call needs its own)."""
    ts = int(time.time() * 1000) + skew_ms
    cid = identity.contributor_id
    nonce = os.urandom(16)
    return pb.Auth(
        contributor_id=cid,
        timestamp_ms=ts,
        nonce=nonce,
        signature=identity.sign(request_statement(method, cid, ts, nonce, digest)),
    )


def auth_of(
    signed: bool, raw: pb.Auth, identity: Identity, method: str, digest: str, skew_ms: int = 0
) -> Callable[[], pb.Auth]:
    """What each attempt of a call sends: a fresh signature, or the fuzzed Auth as drawn."""
    if signed:
        return lambda: auth(identity, method, digest, skew_ms=skew_ms)
    return lambda: raw


fuzzed_auth = st.builds(pb.Auth, contributor_id=text, timestamp_ms=i64, signature=blob, nonce=blob)


def paced(call: Callable[[], object], method: str) -> tuple[object, grpc.RpcError | None]:
    """`call()`'s reply or error. A refusal for the caller's request rate is not the handler's
    answer: the call is made again after the wait it names (`call` builds its request anew, so
    it is signed anew)."""
    for _ in range(MAX_PACED):
        try:
            return call(), None
        except grpc.RpcError as err:
            wait = RETRY_IN.search(err.details() or "")
            if err.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or wait is None:
                return None, err
            PACED[method] += 1
            time.sleep(min(float(wait.group(1)), 5.0) + 0.05)
    raise AssertionError(f"{method}: still refused for its rate after {MAX_PACED} waits")


def expect_clean(call: Callable[[], object], wire: Wire, method: str) -> object:
    """Run `call`; a failure must be a clear status. Counts the case."""
    CASES[method] += 1
    reply, err = paced(call, method)
    if err is not None:
        code, details = err.code(), err.details() or ""
        assert code != grpc.StatusCode.UNKNOWN, f"{method}: unhandled exception: {details}"
        assert details.strip() and "\n" not in details, (
            f"{method}: {code} with unclear message {details!r}"
        )
        assert "Traceback" not in details and "Exception calling application" not in details
    return reply


def still_serving(wire: Wire) -> None:
    probe = FederationClient(wire.address, PROBE, timeout_s=5)
    try:
        assert probe.register("probe").status == "active"
    finally:
        probe.close()


@FUZZ
@given(
    key=st.one_of(blob, st.just(b"")),
    name=text,
    ts=i64,
    sig=blob,
    version=u32,
    signed=st.booleans(),
)
def test_register(
    wire: Wire,
    parties: dict,
    key: bytes,
    name: str,
    ts: int,
    sig: bytes,
    version: int,
    signed: bool,
) -> None:  # type: ignore[type-arg]
    stub = parties["poller"][1].stub
    if signed:  # a valid registration with an arbitrary name reaches the ledger (rate limited)
        from zoo_gym.core.protocol import register_statement

        me = Identity.generate()
        key, ts, version = me.public_key, int(time.time() * 1000), 1
        sig = me.sign(register_statement(key, name, ts))
    request = pb.RegisterRequest(
        protocol_version=version, public_key=key, name=name, timestamp_ms=ts, signature=sig
    )
    if signed:  # active, or refused once this address has used its allowance of new keys
        CASES["Register"] += 1
        try:
            assert stub.Register(request, timeout=10).status == "active"
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.details()
            assert (err.details() or "").startswith("too many new keys registered")
        return
    expect_clean(lambda: stub.Register(request, timeout=10), wire, "Register")


@FUZZ
@given(
    raw_auth=fuzzed_auth,
    signed=st.booleans(),
    wait=st.floats(allow_nan=True, allow_infinity=True),
    skew=st.integers(-(10**9), 10**9),
)
def test_poll(
    wire: Wire, parties: dict, raw_auth: pb.Auth, signed: bool, wait: float, skew: int
) -> None:  # type: ignore[type-arg]
    me, client, _ = parties["poller"]
    a = auth_of(signed, raw_auth, me, "poll", "", skew)
    reply = expect_clean(
        lambda: client.stub.PollTask(pb.PollRequest(auth=a(), wait_s=wait), timeout=35),
        wire,
        "PollTask",
    )
    if reply is not None:
        assert reply.HasField("task")  # the poller's task is still open: answered at once


@FUZZ
@given(
    version=st.one_of(text, st.sampled_from(["v0000", "../v0000", "v0000/../..", "", ".", "/etc"])),
    signed=st.booleans(),
    raw_auth=fuzzed_auth,
)
def test_manifest(wire: Wire, parties: dict, version: str, signed: bool, raw_auth: pb.Auth) -> None:  # type: ignore[type-arg]
    me, client, _ = parties["poller"]
    a = auth_of(signed, raw_auth, me, "manifest", version)
    reply = expect_clean(
        lambda: client.stub.GetManifest(pb.ManifestRequest(auth=a(), version=version), timeout=10),
        wire,
        "GetManifest",
    )
    if reply is not None:
        assert version == "v0000" and reply.signature


@FUZZ
@given(
    version=st.one_of(st.just("v0000"), text),
    file=st.one_of(
        st.sampled_from(
            [
                "model.safetensors",
                "config.json",
                "manifest.json",
                "../coordinator.key",
                "../../coordinator.toml",
                "",
            ]
        ),
        text,
    ),
    offset=st.one_of(u64, st.integers(0, 4096)),
    signed=st.booleans(),
    raw_auth=fuzzed_auth,
)
def test_download(
    wire: Wire,
    parties: dict,
    version: str,
    file: str,
    offset: int,
    signed: bool,  # type: ignore[type-arg]
    raw_auth: pb.Auth,
) -> None:
    me, client, _ = parties["poller"]
    a = auth_of(signed, raw_auth, me, "download", f"{version}/{file}")

    def download() -> list[pb.FileChunk]:
        request = pb.DownloadRequest(auth=a(), version=version, file=file, offset=offset)
        return list(client.stub.DownloadFile(request, timeout=10))

    chunks = expect_clean(download, wire, "DownloadFile")
    if chunks:
        assert (
            "key" not in file and ".." not in file
        )  # only files of a published version are served
        assert all(len(c.data) <= 1 << 20 for c in chunks)


@FUZZ
@given(
    message_id=st.one_of(st.just("task"), text),
    rnd=u32,
    base=st.one_of(st.just("v0000"), text),
    nonce=blob,
    size=st.one_of(st.integers(0, 70_000), u64),
    chunks=st.lists(st.binary(max_size=2048), max_size=6),
    right_sha=st.booleans(),
    flower_reply=st.one_of(st.just(b""), blob),
    signature=blob,
    lead=st.sampled_from(["header", "data", "none"]),
)
def test_submit(
    wire: Wire,
    parties: dict,
    message_id: str,
    rnd: int,
    base: str,
    nonce: bytes,
    size: int,  # type: ignore[type-arg]
    chunks: list[bytes],
    right_sha: bool,
    flower_reply: bytes,
    signature: bytes,
    lead: str,
) -> None:
    me, client, task = parties["submitter"]
    if message_id == "task":
        message_id = task.message.metadata.message_id
    payload = b"".join(chunks)
    sha = hashlib.sha256(payload).hexdigest() if right_sha else hashlib.sha256(nonce).hexdigest()
    if right_sha:
        size = len(payload)

    def stream() -> Iterator[pb.UpdateChunk]:
        if lead == "header":
            header = pb.SubmissionHeader(
                auth=auth(me, "submit", f"{message_id}|{sha}"),
                message_id=message_id,
                round=rnd,
                base_version=base,
                nonce=nonce,
                payload_sha256=sha,
                payload_size=size,
                signature=signature,
                flower_reply=flower_reply,
            )
            yield pb.UpdateChunk(header=header)
        elif lead == "data":
            yield pb.UpdateChunk(data=b"no header first")
        for c in chunks:
            yield pb.UpdateChunk(data=c)

    reply = expect_clean(
        lambda: client.stub.SubmitUpdate(stream(), timeout=10), wire, "SubmitUpdate"
    )
    if reply is not None:
        assert (
            reply.decision == "rejected" and reply.reason
        )  # nothing fuzzed is a valid signed update


@FUZZ
@given(rnd=u32, signed=st.booleans(), raw_auth=fuzzed_auth)
def test_outcome(wire: Wire, parties: dict, rnd: int, signed: bool, raw_auth: pb.Auth) -> None:  # type: ignore[type-arg]
    me, client, _ = parties["poller"]
    a = auth_of(signed, raw_auth, me, "outcome", str(rnd))
    reply = expect_clean(
        lambda: client.stub.GetOutcome(pb.OutcomeRequest(auth=a(), round=rnd), timeout=10),
        wire,
        "GetOutcome",
    )
    if reply is not None:
        assert reply.decision in ("none", "rejected", "accepted", "pending")


@FUZZ
@given(method=st.sampled_from(METHODS), data=st.binary(max_size=512), parts=st.integers(1, 3))
def test_raw_bytes(wire: Wire, parties: dict, method: str, data: bytes, parts: int) -> None:  # type: ignore[type-arg]
    channel = parties["poller"][1].channel
    path = f"/zoo_gym.v1.Federation/{method}"

    def call() -> object:
        if method == "SubmitUpdate":
            return channel.stream_unary(path)(iter([data] * parts), timeout=10)
        if method == "DownloadFile":
            return list(channel.unary_stream(path)(data, timeout=10))
        return channel.unary_unary(path)(data, timeout=10)

    expect_clean(call, wire, f"raw {method}")


def test_huge_claims_are_refused_without_holding_the_upload(wire: Wire, parties: dict) -> None:  # type: ignore[type-arg]
    me, client, task = parties["submitter"]
    mid = task.message.metadata.message_id
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    def header(size: int) -> pb.UpdateChunk:
        return pb.UpdateChunk(
            header=pb.SubmissionHeader(
                auth=auth(me, "submit", f"{mid}|{'0' * 64}"),
                message_id=mid,
                round=1,
                base_version="v0000",
                nonce=os.urandom(16),
                payload_sha256="0" * 64,
                payload_size=size,
                flower_reply=serialize_message(Message(RecordDict(), reply_to=task.message)),
            )
        )

    # a header claiming 2^64 - 1 bytes is refused before any payload is read
    _, huge = paced(lambda: client.stub.SubmitUpdate(iter([header(2**64 - 1)]), timeout=10), "huge")
    # a stream running past its declared size is cut at the first chunk beyond it
    sent = [0]

    def flood() -> Iterator[pb.UpdateChunk]:
        sent[0] = 0
        yield header(1000)
        for _ in range(200):  # up to 200 MiB if the server kept reading
            sent[0] += 1
            yield pb.UpdateChunk(data=b"\0" * (1 << 20))

    _, long = paced(lambda: client.stub.SubmitUpdate(flood(), timeout=30), "long")
    # one message bigger than the transport allows
    _, big = paced(
        lambda: client.stub.SubmitUpdate(
            iter([header(1000), pb.UpdateChunk(data=b"\0" * (8 << 20))]), timeout=10
        ),
        "big",
    )
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024

    assert huge is not None and huge.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "exceeds the 65536-byte limit" in huge.details()
    assert long is not None and long.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "longer than its declared 1000 bytes" in long.details()
    assert sent[0] < 40  # the server stopped reading long before the flood ended
    assert big is not None and big.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert grown_mib < 64, f"peak memory grew by {grown_mib:.0f} MiB"
    spool = wire.co.config.path("spool")
    for _ in range(50):  # the handler threads finish after their callers saw the status
        if not list(spool.glob("*.part")):
            break
        time.sleep(0.1)
    assert not list(spool.glob("*.part"))  # nothing half-written is left behind
    still_serving(wire)


def test_server_survives_the_fuzzing(wire: Wire) -> None:
    still_serving(wire)
