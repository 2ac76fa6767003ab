"""The contributor's side of the wire.

`FederationClient` registers, long-polls, downloads signed models with resume,
and streams a ClientApp's reply up in chunks. gRPC failures become
`TransportError` with one line a person can act on.
"""

from __future__ import annotations

import ipaddress
import re
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
from flwr.app import Message

from zoo_gym.core.hashing import sha256_file
from zoo_gym.core.identity import Identity, verify
from zoo_gym.core.manifest import MANIFEST, SIGNATURE, FileEntry, ModelManifest
from zoo_gym.core.protocol import (
    CALL_NONCE_BYTES,
    PROTOCOL_VERSION,
    Outcome,
    Registration,
    register_statement,
    request_statement,
)
from zoo_gym.proto.v1 import federation_pb2 as pb
from zoo_gym.proto.v1 import federation_pb2_grpc as pb_grpc
from zoo_gym.transport.records import header_of, unpack_reply
from zoo_gym.transport.server import CHUNK_BYTES, MAX_HEADER_BYTES, parse_message, serialize_message

RECONNECT_BACKOFF_MAX_MS = 5_000
RETRY_IN = re.compile(r"retry in (\d+(?:\.\d+)?) s")


class TransportError(RuntimeError):
    """The coordinator refused a call or could not be reached; the message says what to do."""

    def __init__(
        self, message: str, *, code: str = "", transient: bool = False, retry_after_s: float = 0.0
    ) -> None:
        super().__init__(message)
        self.code = code
        # the coordinator could not be reached, or is busy: the same call may work later
        self.transient = transient
        # how long the coordinator asked to wait before trying again (0: it did not say)
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class ReceivedTask:
    message: Message
    round: int
    base_version: str
    deadline_ms: int
    max_upload_bytes: int


@dataclass(frozen=True)
class SubmitResult:
    accepted: bool
    reason: str
    submission_id: int
    payload_bytes: int


def _describe(err: grpc.RpcError, target: str) -> TransportError:
    code = err.code()
    details = str(err.details())
    if code == grpc.StatusCode.UNAVAILABLE and (
        "handshake" in details.lower() or "CERTIFICATE" in details
    ):
        return TransportError(
            f"the TLS handshake with the coordinator at {target} failed ({details}); pass its CA certificate "
            "with --ca-cert and use a host name its certificate names",
            code=code.name,
        )
    if code == grpc.StatusCode.UNAVAILABLE:
        return TransportError(
            f"cannot reach the coordinator at {target} ({err.details()}); check the address and that it is running",
            code=code.name,
            transient=True,
        )
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and (wait := RETRY_IN.search(details)):
        # over one of the service's limits (open calls, rate): busy, not a refusal of the call
        return TransportError(
            f"the coordinator at {target} is busy ({details})",
            code=code.name,
            transient=True,
            retry_after_s=float(wait.group(1)),
        )
    if code == grpc.StatusCode.DEADLINE_EXCEEDED and details != "Deadline Exceeded":
        # the coordinator's own deadline (a request or upload data that did not come in time)
        return TransportError(details, code=code.name, transient=True)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return TransportError(
            f"the coordinator at {target} did not answer in time; try again",
            code=code.name,
            transient=True,
        )
    return TransportError(str(err.details()), code=code.name)


def is_loopback(target: str) -> bool:
    """Whether HOST:PORT names this machine (localhost, 127.0.0.0/8 or [::1])."""
    return is_loopback_host(target.rsplit(":", 1)[0])


def is_loopback_host(host: str) -> bool:
    """Whether a host name or address (IPv6 with or without brackets) is this machine."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class FederationClient:
    def __init__(
        self,
        target: str,
        identity: Identity,
        *,
        root_certificates: bytes | None = None,
        plaintext: bool | None = None,
        timeout_s: float = 30.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """A client of the coordinator at `target` (HOST:PORT).

        TLS is checked against `root_certificates` when given, else against the system's trusted
        CAs. Plaintext only when `plaintext` says so, or by default for a loopback address.
        """
        self.target = target
        self.identity = identity
        self.timeout_s = timeout_s
        self.clock = clock
        options = [
            ("grpc.max_receive_message_length", CHUNK_BYTES * 4 + MAX_HEADER_BYTES),
            ("grpc.max_send_message_length", CHUNK_BYTES * 4 + MAX_HEADER_BYTES),
            # gRPC's default backoff grows to 120 s between connection attempts: a coordinator
            # that restarted would see its contributors only minutes later
            ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MAX_MS),
            # a connection of its own: gRPC otherwise shares one between the channels of a
            # process, and the coordinator takes 100 calls at once per connection (many
            # contributors simulated in one process were refused with RST_STREAM)
            ("grpc.use_local_subchannel_pool", 1),
        ]
        if plaintext is None:
            plaintext = root_certificates is None and is_loopback(target)
        if plaintext:
            self.channel = grpc.insecure_channel(target, options=options)
        else:
            creds = grpc.ssl_channel_credentials(root_certificates=root_certificates)
            self.channel = grpc.secure_channel(target, creds, options=options)
        self.stub = pb_grpc.FederationStub(self.channel)
        self.coordinator_key = b""

    def close(self) -> None:
        self.channel.close()

    def _now_ms(self) -> int:
        return int(self.clock() * 1000)

    def _auth(self, method: str, digest: str) -> pb.Auth:
        """Sign one call; its fresh random nonce makes the signature good for this call only."""
        ts = self._now_ms()
        cid = self.identity.contributor_id
        nonce = secrets.token_bytes(CALL_NONCE_BYTES)
        return pb.Auth(
            contributor_id=cid,
            timestamp_ms=ts,
            nonce=nonce,
            signature=self.identity.sign(request_statement(method, cid, ts, nonce, digest)),
        )

    def register(self, name: str, invite: str = "") -> Registration:
        """Register this key; `invite` is the operator's invitation code where one is needed."""
        ts = self._now_ms()
        key = self.identity.public_key
        request = pb.RegisterRequest(
            protocol_version=PROTOCOL_VERSION,
            public_key=key,
            name=name,
            timestamp_ms=ts,
            signature=self.identity.sign(register_statement(key, name, ts)),
            invite=invite,
        )
        try:
            reply = self.stub.Register(request, timeout=self.timeout_s, wait_for_ready=False)
        except grpc.RpcError as err:
            raise _describe(err, self.target) from None
        self.coordinator_key = reply.coordinator_key
        return Registration(
            contributor_id=reply.contributor_id,
            node_id=reply.node_id,
            status=reply.status,
            current_version=reply.current_version,
            coordinator_key=reply.coordinator_key,
        )

    def poll(self, wait_s: float = 10.0) -> ReceivedTask | None:
        try:
            reply = self.stub.PollTask(
                pb.PollRequest(auth=self._auth("poll", ""), wait_s=wait_s),
                timeout=wait_s + self.timeout_s,
            )
        except grpc.RpcError as err:
            raise _describe(err, self.target) from None
        if not reply.HasField("task"):
            return None
        task = reply.task
        return ReceivedTask(
            message=parse_message(task.flower_message),
            round=task.round,
            base_version=task.base_version,
            deadline_ms=task.deadline_ms,
            max_upload_bytes=task.max_upload_bytes,
        )

    def fetch_model(self, version: str, directory: Path, coordinator_key: bytes) -> ModelManifest:
        """Download `version` into `directory`, resuming partial files; verify signature and hashes.

        Every file is checked against the signed manifest as it lands, so the returned
        manifest describes a verified directory.
        """
        directory.mkdir(parents=True, exist_ok=True)
        try:
            reply = self.stub.GetManifest(
                pb.ManifestRequest(auth=self._auth("manifest", version), version=version),
                timeout=self.timeout_s,
            )
        except grpc.RpcError as err:
            raise _describe(err, self.target) from None
        if not verify(coordinator_key, reply.signature, reply.manifest):
            raise TransportError(
                f"manifest of {version} is not signed by the coordinator key you registered with; "
                "refusing it (is this the right coordinator?)"
            )
        manifest = ModelManifest.from_bytes(reply.manifest)
        for path in directory.iterdir():  # a file the manifest does not list is nobody's
            if path.is_file() and path.name not in manifest.files:
                path.unlink()
        for name, entry in manifest.files.items():
            self._fetch_file(version, name, entry, directory / name)
        (directory / MANIFEST).write_bytes(reply.manifest)
        (directory / SIGNATURE).write_bytes(reply.signature)
        return manifest

    def _fetch_file(self, version: str, name: str, entry: FileEntry, path: Path) -> None:
        """Make `path` match `entry`: keep it if it does, resume a partial file, restart a bad one once."""
        for _ in range(2):
            if (
                path.exists()
                and path.stat().st_size == entry.size
                and sha256_file(path) == entry.sha256
            ):
                return
            if path.exists() and path.stat().st_size >= entry.size:
                path.unlink()  # complete but corrupt: start over
            self._download(version, name, path)
        if sha256_file(path) != entry.sha256:
            raise TransportError(
                f"{name} of {version} does not match its manifest hash after download"
            )

    def _download(self, version: str, name: str, path: Path) -> None:
        offset = path.stat().st_size if path.exists() else 0
        request = pb.DownloadRequest(
            auth=self._auth("download", f"{version}/{name}"),
            version=version,
            file=name,
            offset=offset,
        )
        try:
            with path.open("ab") as fh:
                for chunk in self.stub.DownloadFile(request, timeout=self.timeout_s * 10):
                    fh.write(chunk.data)
        except grpc.RpcError as err:
            raise _describe(err, self.target) from None

    def submit(self, task: ReceivedTask, reply: Message) -> SubmitResult:
        """Stream the reply of a ClientApp: header first, then the payload in chunks.

        The header carries the signed submission; the Flower reply inside it is the rest of the
        reply's content (its training metrics), so no signed field travels twice.
        """
        sub, payload, rest = unpack_reply(reply)
        header = header_of(
            sub,
            self._auth("submit", f"{sub.message_id}|{sub.payload_sha256}"),
            serialize_message(Message(rest, reply_to=task.message)),
        )

        def chunks() -> Iterator[pb.UpdateChunk]:
            yield pb.UpdateChunk(header=header)
            for start in range(0, len(payload), CHUNK_BYTES):
                yield pb.UpdateChunk(data=payload[start : start + CHUNK_BYTES])

        try:
            result = self.stub.SubmitUpdate(chunks(), timeout=self.timeout_s * 10)
        except grpc.RpcError as err:
            raise _describe(err, self.target) from None
        return SubmitResult(
            result.decision == "accepted", result.reason, result.submission_id, len(payload)
        )

    def outcome(self, round_number: int) -> Outcome:
        try:
            r = self.stub.GetOutcome(
                pb.OutcomeRequest(
                    auth=self._auth("outcome", str(round_number)), round=round_number
                ),
                timeout=self.timeout_s,
            )
        except grpc.RpcError as err:
            raise _describe(err, self.target) from None
        return Outcome(
            r.decision, r.reason, r.quality, r.reward, r.round_status, r.published_version
        )
