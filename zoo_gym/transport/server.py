"""The coordinator's gRPC service.

Every handler turns protobuf into domain values, asks the backend, and turns
the answer back; a `RequestError` becomes a gRPC status with its one-line
message. Uploads are spooled to disk chunk by chunk, and refused as soon as they
exceed their declared or the configured size; intake then reads the spooled file
whole, once, to check its hash and envelope (it is at most `max_upload_bytes`).

The server runs on `grpc.aio` in an event loop of its own thread, so a call that waits (a long
poll, an upload between chunks, a call whose request has not come) holds no thread. Blocking
work runs on a bounded pool shared fairly between addresses and contributors (`WorkerShares`).
Every call is admitted by the `CallGate` before anything is read, and must send its first
message within `first_message_timeout_s`; every method is registered as a client-streaming one
(the same bytes on the wire as a unary request) so that wait can be bounded.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import tempfile
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn, TypeAlias, TypeVar

import grpc
import grpc.aio
from flwr.app import Message
from flwr.common.serde import message_from_proto, message_to_proto
from flwr.proto.message_pb2 import Message as FlowerMessageProto  # type: ignore[attr-defined,unused-ignore]
from google.protobuf.message import DecodeError
from google.protobuf.message import Message as Message_

from zoo_gym.core.protocol import PROTOCOL_VERSION, RequestError
from zoo_gym.proto.v1 import federation_pb2 as pb
from zoo_gym.transport.backend import FederationBackend
from zoo_gym.transport.limits import (
    Admission,
    CallGate,
    RateLimits,
    RefusalPacer,
    Refused,
    WorkerShares,
    peer_host,
    peer_key,
)
from zoo_gym.transport.mailbox import Mailbox, PendingTask
from zoo_gym.transport.records import submission_of_header

log = logging.getLogger(__name__)
T = TypeVar("T")
M = TypeVar("M", bound=Message_)

SERVICE = "zoo_gym.v1.Federation"
CHUNK_BYTES = 1 << 20
MAX_POLL_WAIT_S = 30.0
MAX_HEADER_BYTES = 1 << 20
MAX_STREAMS_PER_CONNECTION = 100


async def _abort(context: grpc.aio.ServicerContext[Any, Any], error: RequestError) -> NoReturn:
    code = getattr(grpc.StatusCode, error.code, grpc.StatusCode.INVALID_ARGUMENT)
    await context.abort(code, error.message)
    raise AssertionError("unreachable")  # abort raises


def serialize_message(message: Message) -> bytes:
    return bytes(message_to_proto(message).SerializeToString())


def parse_message(data: bytes) -> Message:
    proto = FlowerMessageProto()
    proto.ParseFromString(data)
    return message_from_proto(proto)


Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"


@dataclass(eq=False)
class _Poll:
    """A contributor's open long poll: woken when a task is put for it, or when replaced."""

    call: Admission
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    replaced: bool = False


class FederationServicer:
    def __init__(
        self,
        backend: FederationBackend,
        mailbox: Mailbox,
        spool: Path,
        limits: RateLimits | None = None,
        *,
        executor: ThreadPoolExecutor,
    ) -> None:
        self.backend = backend
        self.mailbox = mailbox
        self.spool = spool
        self.limits = limits or RateLimits()
        self.gate = CallGate(self.limits)
        self.pacer = RefusalPacer(self.limits.refusal_delay_s)
        self.shares = WorkerShares(
            executor,
            workers=self.limits.workers,
            per_peer=self.limits.workers_per_peer,
            per_contributor=self.limits.workers_per_contributor,
        )
        self.polls: dict[int, _Poll] = {}
        self.closed = False  # the mailbox closed: long polls answer idle at once
        spool.mkdir(parents=True, exist_ok=True)

    # -- admission ------------------------------------------------------------
    @asynccontextmanager
    async def _admitted(self, context: Context) -> AsyncIterator[Admission]:
        """The call counted by the gate for as long as it runs; refused when over a limit."""
        try:
            call = self.gate.admit(peer_key(context.peer()))
        except Refused as exc:
            await self.pacer.pause()
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        try:
            yield call
        finally:
            self.gate.close(call)

    async def _first(self, context: Context) -> Any:
        """The call's first message, which must come within `first_message_timeout_s`."""
        timeout = self.limits.first_message_timeout_s
        try:
            message = await asyncio.wait_for(context.read(), timeout)
        except TimeoutError:
            await context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"no request arrived within {timeout:g} s of opening the call; send it at once",
            )
        if message is grpc.aio.EOF:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "the call ended before its request was sent"
            )
        return message

    async def _blocking(self, call: Admission, work: Callable[[], T]) -> T:
        return await self.shares.run(call, work)

    async def _auth(
        self,
        call: Admission,
        auth: pb.Auth,
        method: str,
        digest: str,
        context: Context,
        *,
        before_counting: Callable[[int], None] | None = None,
    ) -> int:
        try:
            node = await self._blocking(
                call,
                lambda: self.backend.authenticate(
                    method=method,
                    contributor_id=auth.contributor_id,
                    timestamp_ms=auth.timestamp_ms,
                    nonce=auth.nonce,
                    digest=digest,
                    signature=auth.signature,
                ),
            )
        except RequestError as exc:
            await _abort(context, exc)
        if before_counting is not None:
            before_counting(node)
        try:
            self.gate.sign_in(call, auth.contributor_id)
        except Refused as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        return node

    async def _unary(
        self,
        context: Context,
        kind: type[Message_],
        handle: Callable[[Admission, Any, Context], Awaitable[T]],
    ) -> T:
        async with self._admitted(context) as call:
            request = _decode(kind, await self._first(context))
            if request is None:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _not_a(kind))
            return await handle(call, request, context)

    # -- the methods (each registered as client-streaming; see `handlers`) --------
    async def Register(self, _requests: Any, context: Context) -> pb.RegisterReply:
        return await self._unary(context, pb.RegisterRequest, self._register)

    async def PollTask(self, _requests: Any, context: Context) -> pb.PollReply:
        return await self._unary(context, pb.PollRequest, self._poll)

    async def GetManifest(self, _requests: Any, context: Context) -> pb.ManifestReply:
        return await self._unary(context, pb.ManifestRequest, self._manifest)

    async def GetOutcome(self, _requests: Any, context: Context) -> pb.OutcomeReply:
        return await self._unary(context, pb.OutcomeRequest, self._outcome)

    async def DownloadFile(self, _requests: Any, context: Context) -> None:
        await self._unary(context, pb.DownloadRequest, self._download)

    async def SubmitUpdate(self, _requests: Any, context: Context) -> pb.SubmitReply:
        return await self._unary(context, pb.UpdateChunk, self._submit)

    async def _register(
        self, call: Admission, request: pb.RegisterRequest, context: Context
    ) -> pb.RegisterReply:
        if request.protocol_version != PROTOCOL_VERSION:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"protocol version {request.protocol_version} is not served here (v1); upgrade zoo-gym",
            )
        try:
            reg = await self._blocking(
                call,
                lambda: self.backend.register(
                    public_key=request.public_key,
                    name=request.name,
                    timestamp_ms=request.timestamp_ms,
                    signature=request.signature,
                    invite=request.invite,
                    peer=peer_host(context.peer()),
                ),
            )
        except RequestError as exc:
            if exc.code == "RESOURCE_EXHAUSTED":  # the allowance for new keys is spent
                await self.pacer.pause()
            await _abort(context, exc)
        return pb.RegisterReply(
            contributor_id=reg.contributor_id,
            node_id=reg.node_id,
            status=reg.status,
            current_version=reg.current_version,
            coordinator_key=reg.coordinator_key,
        )

    # -- long polls -------------------------------------------------------------
    def _replace_poll(self, node: int) -> None:
        """A newer poll of `node` replaces its open one, which answers idle and frees its slot."""
        older = self.polls.pop(node, None)
        if older is not None:
            older.replaced = True
            self.gate.close(older.call)
            older.wake.set()

    def _task_put(self, node: int | None) -> None:
        """Wake `node`'s long poll: a task was put for it; every poll (None): the mailbox closed."""
        if node is None:
            self.closed = True
        polls = list(self.polls.values()) if node is None else [self.polls.get(node)]
        for poll in polls:
            if poll is not None:
                poll.wake.set()

    async def _wait_task(self, node: int, poll: _Poll, wait_s: float) -> PendingTask | None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while not poll.replaced and not self.closed:
            poll.wake.clear()
            task = self.mailbox.take(node, 0.0)
            remaining = deadline - loop.time()
            if task is not None or remaining <= 0:
                return task
            with suppress(TimeoutError):
                await asyncio.wait_for(poll.wake.wait(), remaining)
        return None

    async def _poll(
        self, call: Admission, request: pb.PollRequest, context: Context
    ) -> pb.PollReply:
        node = await self._auth(
            call, request.auth, "poll", "", context, before_counting=self._replace_poll
        )
        poll = self.polls[node] = _Poll(call)
        try:
            wait_s = min(max(request.wait_s, 0.0), MAX_POLL_WAIT_S)
            task = await self._wait_task(node, poll, wait_s)
        finally:
            if self.polls.get(node) is poll:
                del self.polls[node]
        if task is None:
            version = await self._blocking(call, self.backend.current_version)
            return pb.PollReply(idle=pb.Idle(retry_after_s=1.0, current_version=version))
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

    # -- models -----------------------------------------------------------------
    async def _manifest(
        self, call: Admission, request: pb.ManifestRequest, context: Context
    ) -> pb.ManifestReply:
        await self._auth(call, request.auth, "manifest", request.version, context)
        try:
            manifest, signature = await self._blocking(
                call, lambda: self.backend.manifest(request.version)
            )
        except RequestError as exc:
            await _abort(context, exc)
        return pb.ManifestReply(manifest=manifest, signature=signature)

    async def _download(
        self, call: Admission, request: pb.DownloadRequest, context: Context
    ) -> None:
        digest = f"{request.version}/{request.file}"
        await self._auth(call, request.auth, "download", digest, context)
        try:
            path = await self._blocking(
                call, lambda: self.backend.model_file(request.version, request.file)
            )
        except RequestError as exc:
            await _abort(context, exc)
        fh = path.open("rb")  # here, not on the pool, for the reason `_receive` gives
        try:
            total = os.fstat(fh.fileno()).st_size
            if request.offset > total:
                await context.abort(
                    grpc.StatusCode.OUT_OF_RANGE,
                    f"offset {request.offset} is past the end ({total} bytes)",
                )
            fh.seek(request.offset)
            offset = request.offset
            while offset < total or total == 0:
                chunk = await self._blocking(call, functools.partial(fh.read, CHUNK_BYTES))
                await self._send(context, pb.FileChunk(offset=offset, data=chunk, total_size=total))
                if not chunk:
                    return
                offset += len(chunk)
        finally:
            fh.close()

    async def _send(self, context: Context, message: Any) -> None:
        """Write `message`, giving up on a reader that takes none for `upload_idle_timeout_s`."""
        idle = self.limits.upload_idle_timeout_s
        try:
            await asyncio.wait_for(context.write(message), idle)
        except TimeoutError:
            await context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"the download was not read for {idle:g} s; start it again from its offset",
            )

    async def _outcome(
        self, call: Admission, request: pb.OutcomeRequest, context: Context
    ) -> pb.OutcomeReply:
        await self._auth(call, request.auth, "outcome", str(request.round), context)
        out = await self._blocking(
            call, lambda: self.backend.outcome(request.auth.contributor_id, request.round)
        )
        return pb.OutcomeReply(
            decision=out.decision,
            reason=out.reason,
            quality=out.quality,
            reward=out.reward,
            round_status=out.round_status,
            published_version=out.published_version,
        )

    # -- submissions ------------------------------------------------------------
    async def _refuse(
        self,
        call: Admission,
        context: Context,
        header: pb.SubmissionHeader,
        reason: str,
        *,
        code: grpc.StatusCode,
        advice: str,
    ) -> NoReturn:
        """Record the refusal of a signed submission in the ledger, then end the call."""
        await self._blocking(
            call, lambda: self.backend.refuse(submission_of_header(header), reason)
        )
        await context.abort(code, f"{reason}; {advice}")
        raise AssertionError("unreachable")  # abort raises

    async def _submit(
        self, call: Admission, first: pb.UpdateChunk, context: Context
    ) -> pb.SubmitReply:
        if not first.HasField("header"):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "a submission must start with its header"
            )
        header = first.header
        digest = f"{header.message_id}|{header.payload_sha256}"
        node = await self._auth(call, header.auth, "submit", digest, context)
        task, reply = await self._admissible(call, context, header, node)
        spooled = await self._receive(call, context, header)
        try:
            verdict, content = await self._blocking(
                call,
                lambda: self.backend.receive(
                    submission_of_header(header), spooled.path, reply.content, node_id=node
                ),
            )
        except RequestError as exc:
            await _abort(context, exc)
        finally:
            spooled.path.unlink(missing_ok=True)
        self.mailbox.reply(node, header.message_id, Message(content, reply_to=task.message))
        return pb.SubmitReply(
            decision="accepted" if verdict.accepted else "rejected",
            reason=verdict.reason,
            submission_id=verdict.submission_id,
        )

    async def _admissible(
        self, call: Admission, context: Context, header: pb.SubmissionHeader, node: int
    ) -> tuple[PendingTask, Message]:
        """The open task a signed header answers and its Flower reply; else a recorded refusal."""
        limit = self.backend.max_upload_bytes
        if header.payload_size > limit:
            reason = f"update of {header.payload_size} bytes exceeds the {limit}-byte limit"
            await self._refuse(
                call,
                context,
                header,
                reason,
                code=grpc.StatusCode.RESOURCE_EXHAUSTED,
                advice="use a smaller codec or group size",
            )
        task = self.mailbox.task(node, header.message_id)
        if task is None:
            reason = f"no open task {header.message_id[:12]!r} for you (round {header.round} is closed, already answered or was never yours)"
            await self._refuse(
                call,
                context,
                header,
                reason,
                code=grpc.StatusCode.FAILED_PRECONDITION,
                advice="wait for the next round",
            )
        try:
            reply = await self._blocking(call, lambda: parse_message(header.flower_reply))
        except Exception:
            reason = "the header's flower_reply is not a serialised Flower Message"
            await self._refuse(
                call,
                context,
                header,
                reason,
                code=grpc.StatusCode.INVALID_ARGUMENT,
                advice="send the reply your ClientApp produced",
            )
        return task, reply

    async def _receive(
        self, call: Admission, context: Context, header: pb.SubmissionHeader
    ) -> _Spool:
        """The payload spooled to disk; the call ends when it is broken or too long.

        A broken transmission (truncated, or silent for `upload_idle_timeout_s`) is not a
        decision about the submission: nothing is recorded (its nonce stays unused), so the same
        signed submission can simply be sent again. One longer than its signed size is refused
        and recorded.
        """
        # opened here, not on the worker pool: a call cancelled while it waited for the pool
        # would leave the file (and its descriptor) open for nobody to remove
        spool = _Spool.open(self.spool, header.payload_size)
        idle = self.limits.upload_idle_timeout_s
        try:
            while True:
                try:
                    chunk = await asyncio.wait_for(context.read(), idle)
                except TimeoutError:
                    raise RequestError(
                        "DEADLINE_EXCEEDED",
                        f"no upload data for {idle:g} s; the upload was dropped, send it again",
                    ) from None
                if chunk is grpc.aio.EOF:
                    break
                decoded = _decode(pb.UpdateChunk, chunk)
                if decoded is None:
                    raise RequestError("INVALID_ARGUMENT", _not_a(pb.UpdateChunk))
                await self._blocking(call, functools.partial(spool.write, decoded.data))
            spool.finish()
        except _TooLong as exc:
            spool.discard()
            await self._refuse(
                call,
                context,
                header,
                exc.message,
                code=grpc.StatusCode.INVALID_ARGUMENT,
                advice="send the header that matches the payload",
            )
        except RequestError as exc:
            spool.discard()
            await _abort(context, exc)
        except BaseException:
            spool.discard()
            raise
        return spool


def _decode(kind: type[M], data: bytes) -> M | None:
    """`data` parsed as a `kind` message; None when it is not one."""
    try:
        return kind.FromString(data)
    except DecodeError:
        return None


def _not_a(kind: type[Message_]) -> str:
    return f"the request is not a valid {kind.DESCRIPTOR.name} message; use a zoo-gym client of protocol v1"


class _TooLong(RequestError):
    pass


@dataclass
class _Spool:
    """A payload being written to a file in the spool directory (intake reads it once, and
    checks its size and SHA-256 against the signed statement)."""

    path: Path
    declared: int
    fd: int
    received: int = 0

    @classmethod
    def open(cls, spool: Path, declared: int) -> _Spool:
        fd, name = tempfile.mkstemp(dir=spool, suffix=".part")
        return cls(Path(name), declared, fd)

    def write(self, data: bytes) -> None:
        self.received += len(data)
        if self.received > self.declared:
            raise _TooLong(
                "INVALID_ARGUMENT",
                f"upload is longer than its declared {self.declared} bytes",
            )
        os.write(self.fd, data)

    def finish(self) -> None:
        os.close(self.fd)
        self.fd = -1
        if self.received != self.declared:
            raise RequestError(
                "DATA_LOSS",
                f"upload ended after {self.received} of {self.declared} bytes (truncated); send it again",
            )

    def discard(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.path.unlink(missing_ok=True)


def handlers(servicer: FederationServicer) -> dict[str, grpc.RpcMethodHandler]:
    """Every method as a client-streaming handler, so the server sees a call before its request
    has arrived and can bound the wait for it (a unary handler is only called afterwards).
    Requests come as bytes: the handler parses them and answers one that is not a message."""

    def one(behaviour: Any, reply: type[Message_]) -> grpc.RpcMethodHandler:
        return grpc.stream_unary_rpc_method_handler(
            behaviour, response_serializer=reply.SerializeToString
        )

    return {
        "Register": one(servicer.Register, pb.RegisterReply),
        "PollTask": one(servicer.PollTask, pb.PollReply),
        "GetManifest": one(servicer.GetManifest, pb.ManifestReply),
        "DownloadFile": grpc.stream_stream_rpc_method_handler(
            servicer.DownloadFile, response_serializer=pb.FileChunk.SerializeToString
        ),
        "SubmitUpdate": one(servicer.SubmitUpdate, pb.SubmitReply),
        "GetOutcome": one(servicer.GetOutcome, pb.OutcomeReply),
    }


@dataclass
class ServerHandle:
    """The service running on its own event loop thread."""

    server: grpc.aio.Server
    port: int
    loop: asyncio.AbstractEventLoop
    thread: threading.Thread
    executor: ThreadPoolExecutor
    unwatch: Callable[[], None] = lambda: None
    stopped: bool = False

    def stop(self, grace: float = 1.0) -> None:
        if self.stopped:
            return
        self.stopped = True
        self.unwatch()
        done = asyncio.run_coroutine_threadsafe(self.server.stop(grace), self.loop)
        done.result(timeout=grace + 30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)
        self.executor.shutdown(wait=False, cancel_futures=True)


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
    limits: RateLimits | None = None,
) -> ServerHandle:
    """Serve the federation on `address` ("host:port"; port 0 picks a free one).

    `tls` returns the (certificate chain PEM, private key PEM) to use now: it is asked before
    every new connection's handshake, so a renewed certificate is served without a restart.
    Without `tls` the port is plaintext.
    `limits` bounds what callers can hold (defaults: `RateLimits()`, see zoo_gym.transport.limits).
    """
    limits = limits or RateLimits()
    executor = ThreadPoolExecutor(max_workers=limits.workers, thread_name_prefix="grpc")
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=_run_loop, args=(loop,), name="grpc-loop", daemon=True)
    thread.start()
    servicer = FederationServicer(backend, mailbox, spool, limits, executor=executor)
    try:
        server, port = asyncio.run_coroutine_threadsafe(
            _serve(servicer, address, tls), loop
        ).result(timeout=60)
    except BaseException:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        executor.shutdown(wait=False)
        raise

    def task_put(node: int | None) -> None:
        with suppress(RuntimeError):  # the loop closed: the server is stopping
            loop.call_soon_threadsafe(servicer._task_put, node)

    mailbox.watch(task_put)
    log.info(
        "federation service listening on %s (%s)",
        address.rsplit(":", 1)[0] + f":{port}",
        "TLS" if tls else "plaintext",
    )
    return ServerHandle(server, port, loop, thread, executor, lambda: mailbox.unwatch(task_put))


def _run_loop(loop: asyncio.AbstractEventLoop) -> None:
    asyncio.set_event_loop(loop)
    try:
        loop.run_forever()
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


async def _serve(
    servicer: FederationServicer, address: str, tls: Callable[[], tuple[bytes, bytes]] | None
) -> tuple[grpc.aio.Server, int]:
    message_bytes = CHUNK_BYTES * 4 + MAX_HEADER_BYTES
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", message_bytes),
            ("grpc.max_send_message_length", message_bytes),
            ("grpc.so_reuseport", 0),
            ("grpc.max_concurrent_streams", MAX_STREAMS_PER_CONNECTION),
            # a connection that never finishes its handshake, or sits with no call, is closed
            ("grpc.server_handshake_timeout_ms", 20_000),
            ("grpc.max_connection_idle_ms", 300_000),
        ]
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE, handlers(servicer)),)
    )
    try:
        if tls is None:
            port = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, following_credentials(tls))
    except RuntimeError:
        port = 0
    if port == 0:
        raise OSError(f"cannot listen on {address}: address in use or not local; pick another port")
    await server.start()
    return server, port
