"""A real `gym-coordinator serve` with its default settings serves each signed call once.

An eavesdropper who captured a contributor's signed calls (poll, manifest, download, outcome)
cannot have them served again; a client of the protocol before per-call nonces is told to
upgrade; the honest contributor's fresh calls go on being served. The fast variant, on an
in-process server, is tests/transport/test_replay.py.
"""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest
from serve_process import serve

from zoo_gym.core.identity import Identity
from zoo_gym.proto.v1 import federation_pb2 as pb
from zoo_gym.proto.v1 import federation_pb2_grpc as pb_grpc
from zoo_gym.transport.client import FederationClient

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # a real serve takes ~15 s to start and stop


def test_captured_calls_are_not_served_again(tiny_home: Path, tmp_path: Path) -> None:
    with serve(tiny_home) as coordinator:
        me = Identity.generate()
        client = FederationClient(coordinator.address, me, timeout_s=10)
        version = client.register("me").current_version
        captured = {
            "PollTask": pb.PollRequest(auth=client._auth("poll", ""), wait_s=0.1),
            "GetManifest": pb.ManifestRequest(
                auth=client._auth("manifest", version), version=version
            ),
            "DownloadFile": pb.DownloadRequest(
                auth=client._auth("download", f"{version}/config.json"),
                version=version,
                file="config.json",
            ),
            "GetOutcome": pb.OutcomeRequest(auth=client._auth("outcome", "1"), round=1),
        }
        for method, request in captured.items():  # the honest calls, as the contributor sent them
            list(call(client.stub, method, request))
        eavesdropper = pb_grpc.FederationStub(grpc.insecure_channel(coordinator.address))

        replays = {m: refusal(eavesdropper, m, r) for m, r in captured.items()}
        old = old_protocol_outcome(me)
        old_client = refusal(eavesdropper, "GetOutcome", old)
        fresh = client.outcome(1)
        client.fetch_model(version, tmp_path / version, client.coordinator_key)

    for method, err in replays.items():
        assert err is not None, f"a replayed {method} was served"
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED, (method, err.details())
        assert err.details().startswith("replayed request: "), err.details()
    assert old_client is not None
    assert old_client.details() == "this client does not send per-call nonces; upgrade zoo-gym"
    assert fresh.decision == "none"


def call(stub: pb_grpc.FederationStub, method: str, request: object) -> list[object]:
    reply = getattr(stub, method)(request, timeout=10)
    return list(reply) if method == "DownloadFile" else [reply]


def refusal(stub: pb_grpc.FederationStub, method: str, request: object) -> grpc.RpcError | None:
    try:
        call(stub, method, request)
    except grpc.RpcError as err:
        return err
    return None


def old_protocol_outcome(me: Identity) -> pb.OutcomeRequest:
    """What a client of the previous protocol sends: no nonce, a version-1 statement."""
    ts = int(time.time() * 1000)
    cid = me.contributor_id
    statement = f"zoo-gym/v1|outcome|{cid}|{ts}|1".encode()
    auth = pb.Auth(contributor_id=cid, timestamp_ms=ts, signature=me.sign(statement))
    return pb.OutcomeRequest(auth=auth, round=1)
