"""Coverage-guided fuzzing of the gRPC handlers with atheris (not part of the test suite).

Run (a coordinator home is built in a temporary directory; the server listens on 127.0.0.1):

    .venv/bin/pip install atheris
    .venv/bin/python tests/transport/atheris_handlers.py -runs=20000

Each input picks an RPC with its first byte; the rest is sent as that RPC's raw request bytes
(for GetManifest and GetOutcome, half of the inputs are first wrapped as a correctly signed
request whose fields come from the input, so they reach the handler's own checks). A status of UNKNOWN (an unhandled exception) or
a message of more than one line stops the run with the input that caused it.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import atheris

with atheris.instrument_imports():
    import grpc

    from zoo_gym.coordinator.setup import init_home
    from zoo_gym.core.identity import Identity
    from zoo_gym.core.protocol import request_statement
    from zoo_gym.proto.v1 import federation_pb2 as pb

sys.path.insert(0, str(Path(__file__).parent))
from wire import build_wire

METHODS = ("Register", "PollTask", "GetManifest", "DownloadFile", "SubmitUpdate", "GetOutcome")


def main() -> None:
    home = Path(tempfile.mkdtemp()) / "coordinator"
    init_home(home, tiny=True, settings="")
    wire = build_wire(home, settings="max_upload_bytes = 65536")
    me = Identity.generate()
    wire.client(me).register("fuzzer")
    channel = grpc.insecure_channel(wire.address)

    def signed(method: str, digest: str) -> pb.Auth:
        ts = int(time.time() * 1000)
        cid = me.contributor_id
        nonce = os.urandom(16)
        return pb.Auth(
            contributor_id=cid,
            timestamp_ms=ts,
            nonce=nonce,
            signature=me.sign(request_statement(method, cid, ts, nonce, digest)),
        )

    def one_input(data: bytes) -> None:
        fdp = atheris.FuzzedDataProvider(data)
        method = METHODS[fdp.ConsumeIntInRange(0, len(METHODS) - 1)]
        wrap = fdp.ConsumeBool()
        rest = fdp.ConsumeBytes(fdp.remaining_bytes())
        path = f"/zoo_gym.v1.Federation/{method}"
        if wrap and method == "GetManifest":
            rest = pb.ManifestRequest(
                auth=signed("manifest", rest.decode(errors="replace")),
                version=rest.decode(errors="replace"),
            ).SerializeToString()
        elif wrap and method == "GetOutcome":
            rest = pb.OutcomeRequest(
                auth=signed("outcome", str(len(rest))), round=len(rest)
            ).SerializeToString()
        try:
            if method == "SubmitUpdate":
                channel.stream_unary(path)(iter([rest]), timeout=10)
            elif method == "DownloadFile":
                list(channel.unary_stream(path)(rest, timeout=10))
            else:
                channel.unary_unary(path)(rest, timeout=10)
        except grpc.RpcError as err:
            details = err.details() or ""
            if err.code() == grpc.StatusCode.UNKNOWN or "\n" in details or not details.strip():
                raise AssertionError(f"{method}: {err.code()} {details!r}") from None

    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
