"""The coordinator's gRPC service.

Every handler turns protobuf into domain values, asks the backend, and turns
the answer back; a `RequestError` becomes a gRPC status with its one-line
message. Uploads are spooled to disk while hashed, never held whole in memory,
and refused as soon as they exceed their declared or the configured size.
"""

from __future__ import annotations

import hashlib
import logging
import tempfile
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
from flwr.app import Message
from flwr.common.serde import message_from_proto, message_to_proto
from flwr.proto.message_pb2 import Message as FlowerMessageProto  # type: ignore[attr-defined,unused-ignore]

from zoo_gym.core.protocol import RequestError, Submission
from zoo_gym.proto.v1 import federation_pb2 as pb
from zoo_gym.proto.v1 import federation_pb2_grpc as pb_grpc
from zoo_gym.transport.backend import FederationBackend
from zoo_gym.transport.limits import RateLimitInterceptor, RateLimits, TokenBuckets, peer_host
from zoo_gym.transport.mailbox import Mailbox

log = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20
MAX_POLL_WAIT_S = 30.0
MAX_HEADER_BYTES = 1 << 20


def _abort(context: grpc.ServicerContext, error: RequestError) -> None:
    code = getattr(grpc.StatusCode, error.code, grpc.StatusCode.INVALID_ARGUMENT)
    context.abort(code, error.message)


def serialize_message(message: Message) -> bytes:
    return bytes(message_to_proto(message).SerializeToString())


def parse_message(data: bytes) -> Message:
    proto = FlowerMessageProto()
    proto.ParseFromString(data)
    return message_from_proto(proto)


class FederationServicer(pb_grpc.FederationServicer):
    def __init__(
        self,
        backend: FederationBackend,
        mailbox: Mailbox,
        spool: Path,
        limits: RateLimits | None = None,
    ) -> None:
        self.backend = backend
        self.mailbox = mailbox
        self.spool = spool
        self.limits = limits or RateLimits()
        self.per_contributor = TokenBuckets(
            self.limits.contributor_rate_per_s, self.limits.contributor_burst
        )
        spool.mkdir(parents=True, exist_ok=True)

    def _auth(self, auth: pb.Auth, method: str, digest: str, context: grpc.ServicerContext) -> int:
        try:
            node = self.backend.authenticate(
                method=method,
                contributor_id=auth.contributor_id,
                timestamp_ms=auth.timestamp_ms,
                nonce=auth.nonce,
                digest=digest,
                signature=auth.signature,
            )
        except RequestError as exc:
            _abort(context, exc)
            raise AssertionError("unreachable") from exc
        # counted only once the caller proved its key, so nobody can spend another's allowance
        wait = self.per_contributor.take(auth.contributor_id)
        if wait > 0:
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"too many requests from contributor {auth.contributor_id[:12]} "
                f"({self.limits.contributor_rate_per_s:g}/s allowed); retry in {wait:.1f} s",
            )
        return node

    def Register(
        self, request: pb.RegisterRequest, context: grpc.ServicerContext
    ) -> pb.RegisterReply:
        if request.protocol_version != 1:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"protocol version {request.protocol_version} is not served here (v1); upgrade zoo-gym",
            )
        try:
            reg = self.backend.register(
                public_key=request.public_key,
                name=request.name,
                timestamp_ms=request.timestamp_ms,
                signature=request.signature,
                invite=request.invite,
                peer=peer_host(context.peer()),
            )
        except RequestError as exc:
            _abort(context, exc)
            raise
        return pb.RegisterReply(
            contributor_id=reg.contributor_id,
            node_id=reg.node_id,
            status=reg.status,
            current_version=reg.current_version,
            coordinator_key=reg.coordinator_key,
        )

    def PollTask(self, request: pb.PollRequest, context: grpc.ServicerContext) -> pb.PollReply:
        node_id = self._auth(request.auth, "poll", "", context)
        wait_s = min(max(request.wait_s, 0.0), MAX_POLL_WAIT_S)
        task = self.mailbox.take(node_id, wait_s)
        if task is None:
            return pb.PollReply(
                idle=pb.Idle(retry_after_s=1.0, current_version=self.backend.current_version())
            )
        return pb.PollReply(
            task=pb.Task(
                message_id=task.message.metadata.message_id,
                round=task.round,
                base_version=task.base_version,
                deadline_ms=task.deadline_ms,
                max_upload_bytes=self.backend.max_upload_bytes,
                flower_message=serialize_message(task.message),
            )
        )

    def GetManifest(
        self, request: pb.ManifestRequest, context: grpc.ServicerContext
    ) -> pb.ManifestReply:
        self._auth(request.auth, "manifest", request.version, context)
        try:
            manifest, signature = self.backend.manifest(request.version)
        except RequestError as exc:
            _abort(context, exc)
            raise
        return pb.ManifestReply(manifest=manifest, signature=signature)

    def DownloadFile(
        self, request: pb.DownloadRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.FileChunk]:
        self._auth(request.auth, "download", f"{request.version}/{request.file}", context)
        try:
            path = self.backend.model_file(request.version, request.file)
        except RequestError as exc:
            _abort(context, exc)
            raise
        total = path.stat().st_size
        if request.offset > total:
            context.abort(
                grpc.StatusCode.OUT_OF_RANGE,
                f"offset {request.offset} is past the end ({total} bytes)",
            )
        with path.open("rb") as fh:
            fh.seek(request.offset)
            offset = request.offset
            while chunk := fh.read(CHUNK_BYTES):
                yield pb.FileChunk(offset=offset, data=chunk, total_size=total)
                offset += len(chunk)
        if total == 0:
            yield pb.FileChunk(offset=0, data=b"", total_size=0)

    def SubmitUpdate(
        self, request_iterator: Iterator[pb.UpdateChunk], context: grpc.ServicerContext
    ) -> pb.SubmitReply:
        first = next(request_iterator, None)
        if first is None or not first.HasField("header"):
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "a submission must start with its header"
            )
            raise AssertionError("unreachable")
        header = first.header
        node_id = self._auth(
            header.auth, "submit", f"{header.message_id}|{header.payload_sha256}", context
        )
        limit = self.backend.max_upload_bytes
        if header.payload_size > limit:
            self.backend.refuse(
                _submission(header),
                f"update of {header.payload_size} bytes exceeds the {limit}-byte limit",
            )
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"update of {header.payload_size} bytes exceeds the {limit}-byte limit; use a smaller codec or group size",
            )
        task = self.mailbox.task(node_id, header.message_id)
        if task is None:
            reason = f"no open task {header.message_id[:12]!r} for you (round {header.round} is closed, already answered or was never yours)"
            self.backend.refuse(_submission(header), reason)
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{reason}; wait for the next round")
            raise AssertionError("unreachable")
        try:
            reply = parse_message(header.flower_reply)
        except Exception:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "the header's flower_reply is not a serialised Flower Message; send the reply your ClientApp produced",
            )
            raise AssertionError("unreachable") from None
        # A broken transmission is not a decision about the submission: nothing is recorded
        # (its nonce stays unused), so the same signed submission can simply be sent again.
        try:
            spooled = _Spool.receive(self.spool, request_iterator, header.payload_size)
        except RequestError as exc:
            _abort(context, exc)
            raise
        try:
            if spooled.sha256 != header.payload_sha256:
                context.abort(
                    grpc.StatusCode.DATA_LOSS,
                    f"payload SHA-256 {spooled.sha256[:16]}... differs from the header's; the upload was corrupted, send it again",
                )
            submission = _submission(header)
            try:
                verdict, content = self.backend.receive(
                    submission, spooled.path, reply.content, node_id=node_id
                )
            except RequestError as exc:
                _abort(context, exc)
                raise
            self.mailbox.reply(node_id, header.message_id, Message(content, reply_to=task.message))
        finally:
            spooled.path.unlink(missing_ok=True)
        return pb.SubmitReply(
            decision="accepted" if verdict.accepted else "rejected",
            reason=verdict.reason,
            submission_id=verdict.submission_id,
        )

    def GetOutcome(
        self, request: pb.OutcomeRequest, context: grpc.ServicerContext
    ) -> pb.OutcomeReply:
        self._auth(request.auth, "outcome", str(request.round), context)
        out = self.backend.outcome(request.auth.contributor_id, request.round)
        return pb.OutcomeReply(
            decision=out.decision,
            reason=out.reason,
            quality=out.quality,
            reward=out.reward,
            round_status=out.round_status,
            published_version=out.published_version,
        )


def _submission(header: pb.SubmissionHeader) -> Submission:
    return Submission(
        contributor_id=header.auth.contributor_id,
        round=header.round,
        base_version=header.base_version,
        message_id=header.message_id,
        nonce=header.nonce,
        payload_sha256=header.payload_sha256,
        payload_size=header.payload_size,
        signature=header.signature,
    )


@dataclass
class _Spool:
    path: Path
    sha256: str

    @classmethod
    def receive(cls, spool: Path, chunks: Iterator[pb.UpdateChunk], declared: int) -> _Spool:
        """Write `chunks` to a file in `spool` while hashing; RequestError when the length is wrong."""
        digest = hashlib.sha256()
        received = 0
        fd, name = tempfile.mkstemp(dir=spool, suffix=".part")
        path = Path(name)
        try:
            with open(fd, "wb") as fh:
                for chunk in chunks:
                    data = chunk.data
                    received += len(data)
                    if received > declared:
                        raise RequestError(
                            "INVALID_ARGUMENT",
                            f"upload is longer than its declared {declared} bytes; send the header that matches the payload",
                        )
                    digest.update(data)
                    fh.write(data)
            if received != declared:
                raise RequestError(
                    "DATA_LOSS",
                    f"upload ended after {received} of {declared} bytes (truncated); send it again",
                )
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        return cls(path, digest.hexdigest())


@dataclass
class ServerHandle:
    server: grpc.Server
    port: int

    def stop(self, grace: float = 1.0) -> None:
        self.server.stop(grace).wait()


def following_credentials(current: Callable[[], tuple[bytes, bytes]]) -> grpc.ServerCredentials:
    """Credentials that switch to whatever pair `current` returns, at the next handshake."""
    served = [current()]

    def fetch() -> grpc.ServerCertificateConfiguration | None:
        pair = current()
        if pair == served[0]:
            return None
        served[0] = pair
        return grpc.ssl_server_certificate_configuration([(pair[1], pair[0])])

    initial = grpc.ssl_server_certificate_configuration([(served[0][1], served[0][0])])
    return grpc.dynamic_ssl_server_credentials(initial, fetch)


def start_server(
    backend: FederationBackend,
    mailbox: Mailbox,
    *,
    address: str,
    spool: Path,
    tls: Callable[[], tuple[bytes, bytes]] | None = None,
    max_workers: int = 32,
    limits: RateLimits | None = None,
) -> ServerHandle:
    """Serve the federation on `address` ("host:port"; port 0 picks a free one).

    `tls` returns the (certificate chain PEM, private key PEM) to use now: it is asked before
    every new connection's handshake, so a renewed certificate is served without a restart.
    Without `tls` the port is plaintext.
    `limits` caps request rates per peer and per contributor (defaults: `RateLimits()`).
    """
    limits = limits or RateLimits()
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc"),
        interceptors=[RateLimitInterceptor(limits)],
        options=[
            ("grpc.max_receive_message_length", CHUNK_BYTES * 4 + MAX_HEADER_BYTES),
            ("grpc.max_send_message_length", CHUNK_BYTES * 4 + MAX_HEADER_BYTES),
            ("grpc.so_reuseport", 0),
        ],
    )
    pb_grpc.add_FederationServicer_to_server(
        FederationServicer(backend, mailbox, spool, limits), server
    )
    if tls is None:
        port = server.add_insecure_port(address)
    else:
        port = server.add_secure_port(address, following_credentials(tls))
    if port == 0:
        raise OSError(f"cannot listen on {address}: address in use or not local; pick another port")
    server.start()
    log.info(
        "federation service listening on %s (%s)",
        address.rsplit(":", 1)[0] + f":{port}",
        "TLS" if tls else "plaintext",
    )
    return ServerHandle(server, port)
