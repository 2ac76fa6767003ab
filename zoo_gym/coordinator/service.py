"""The coordinator process: composition root for `gym-coordinator serve`.

It wires the ledger, the model registry, intake, the strategy and the round
loop, then serves gRPC (contributors), REST (operators) and runs the ServerApp
over the gRPC Grid until the configured rounds are done or it is stopped.

Stopping: the round loop runs in a thread of its own and the main thread handles SIGINT and
SIGTERM. The first signal ends `serve` within `STOP_WITHIN_S` in any state: the Grid's wait for
replies wakes (`Mailbox.close`), the open round is recorded aborted ("coordinator stopping"), the
gRPC and REST servers stop and the ledger gets a signed checkpoint. A second signal ends the
process at once.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from flwr.app import Context, RecordDict

from zoo_gym import ledger
from zoo_gym.coordinator.backend import AdmissionPolicy, CoordinatorBackend
from zoo_gym.coordinator.config import CoordinatorConfig
from zoo_gym.coordinator.control import RoundControl
from zoo_gym.coordinator.evaluation import Evaluator
from zoo_gym.coordinator.liveness import LoopHealth, LoopStatus
from zoo_gym.coordinator.metrics import CoordinatorMetrics
from zoo_gym.coordinator.registry import ModelRegistry
from zoo_gym.coordinator.strategy import ZooStrategy
from zoo_gym.core.delta import Layout
from zoo_gym.core.identity import Identity
from zoo_gym.ledger import Session
from zoo_gym.transport.flower_internals import set_task_identity

if TYPE_CHECKING:
    import ssl

    from zoo_gym.coordinator.api.app import RestServer
    from zoo_gym.coordinator.rounds import RoundSummary
    from zoo_gym.coordinator.tls import CertificateWatcher, ServedPair
    from zoo_gym.transport.mailbox import Mailbox
    from zoo_gym.transport.server import ServerHandle

log = logging.getLogger(__name__)
SERVERAPP_NODE_ID = 0
STOP_WITHIN_S = 30.0
"""A signal ends `serve` within this many seconds (deploy/ gives it 45 before killing it)."""
LOOP_STOP_S = 20.0
"""Of that, how long `serve` waits for the round loop to close its open round."""


def clear_spool(spool: Path) -> int:
    """Remove the `*.part` files in `spool`: uploads a stopped or killed coordinator never
    finished (nothing reads them again). Returns how many there were."""
    removed = 0
    for part in spool.glob("*.part"):
        part.unlink(missing_ok=True)
        removed += 1
    if removed:
        log.info("removed %d unfinished upload(s) left in %s", removed, spool)
    return removed


def admission_policy(config: CoordinatorConfig) -> AdmissionPolicy:
    """The `[admission and intake]` settings that decide who may register a new key."""
    return AdmissionPolicy(
        config.admission,
        config.registration_rate_per_s,
        config.registration_burst,
        config.registration_rate_per_address_per_s,
        config.registration_burst_per_address,
        config.registration_reserve,
    )


class Coordinator:
    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config
        self.signer = Identity.load(config.path(config.signing_key))
        self.engine = ledger.open_database(config.ledger_url)
        self.registry = ModelRegistry(config.path("models"), self.signer)
        self.control = RoundControl()  # operators' requests (REST), read by the round loop
        self.metrics = CoordinatorMetrics()
        self.backend = CoordinatorBackend(
            engine=self.engine,
            registry=self.registry,
            signer=self.signer,
            payload_dir=config.path("payloads"),
            max_upload_bytes=config.max_upload_bytes,
            clock_skew_s=config.clock_skew_s,
            admission=admission_policy(config),
            metrics=self.metrics,
            max_submissions_per_round=config.max_submissions_per_round,
        )
        self.evaluator = Evaluator(
            self.registry.latest().directory,
            config.path(config.validation_data),
            max_length=config.training.max_length,
        )
        self.stop = threading.Event()
        self.health = LoopHealth()  # what the round loop is doing, for /health and metrics

    def apply_policy(self, config: CoordinatorConfig) -> None:
        """Use `config` from the next round on (a policy change staged through the REST API)."""
        self.config = config
        self.backend.admission = admission_policy(config)
        self.backend.max_upload_bytes = config.max_upload_bytes
        self.backend.clock_skew_s = config.clock_skew_s
        self.backend.max_submissions_per_round = config.max_submissions_per_round

    def sign_checkpoint(self, session: Session) -> ledger.Checkpoint:
        """Sign the ledger's current tree head and append it to `checkpoint_copy` when set."""
        head = ledger.checkpoint(session, signer=self.signer)
        self.copy_checkpoint(head)
        return head

    def copy_checkpoint(self, head: ledger.Checkpoint | None) -> None:
        """Append `head` to `checkpoint_copy`, when set.

        A copy that cannot be written is logged, not raised: the checkpoint is signed and stored,
        and the round goes on; the operator repairs the copy's storage.
        """
        copy = self.config.checkpoint_copy
        if copy is None or head is None:
            return
        target = self.config.path(copy)
        try:
            ledger.append_checkpoint(
                target, ledger.SignedCheckpoint.of(head, self.signer.public_key)
            )
        except OSError as exc:
            log.error(
                "checkpoint of size %d was not copied to %s (%s); fix checkpoint_copy's "
                "storage, the next checkpoint is copied again",
                head.size,
                target,
                exc.strerror or exc,
            )

    def make_strategy(self, layout: Callable[[], Layout]) -> ZooStrategy:
        c = self.config
        return ZooStrategy(
            self.backend,
            rule=c.aggregator,
            f=c.byzantine_f,
            params=c.aggregator_params,
            pre=c.pre,
            min_clients=c.min_clients,
            clients_per_round=c.clients_per_round,
            quorum=c.quorum,
            wait_for_clients_s=c.wait_for_clients_s,
            stop=self.stop,
            layout=layout,
            selection_floor=c.rewards.selection_floor,
            keep_rows=c.rewards.method != "none",
            trusted_reputation=c.trusted_reputation,
            fresh_weight=c.fresh_weight,
        )

    def run(self, grid: object, *, on_round: Callable[[RoundSummary], None] | None = None) -> None:
        """Run the ServerApp on `grid` in this thread."""
        from zoo_gym.coordinator.rounds import make_server_app

        set_task_identity(run_id=1, node_id=SERVERAPP_NODE_ID, task_id=1)
        context = Context(
            run_id=1, node_id=SERVERAPP_NODE_ID, node_config={}, state=RecordDict(), run_config={}
        )
        make_server_app(self, on_round=on_round)(grid, context)  # type: ignore[arg-type]

    def run_loop(self, grid: object) -> None:
        """`run`, with a crash recorded in `self.health` (serve runs this in a thread of its own)."""
        try:
            self.run(grid)
        except Exception as exc:
            log.exception("the round loop crashed")
            message = (str(exc).splitlines() or [""])[0]
            self.health.set("crashed", f"round loop crashed: {type(exc).__name__}: {message}")

    def _serve_tls(self, rest: RestServer) -> CertificateWatcher:
        """The served certificate for gRPC and REST, followed through renewals on disk."""
        from uvicorn.config import create_ssl_context

        from zoo_gym.coordinator.tls import CertificateWatcher, follow_in_ssl_context

        c = self.config
        assert c.tls_cert is not None and c.tls_key is not None
        cert, key = c.path(c.tls_cert), c.path(c.tls_key)
        watcher = CertificateWatcher(cert, key, interval_s=c.tls_reload_s)
        self._note_certificate(watcher.current)
        watcher.on_change.append(self._note_certificate)
        # REST serves HTTPS with the same certificate; uvicorn's context follows a renewal too
        config = rest.server.config
        config.ssl_certfile, config.ssl_keyfile = str(cert), str(key)
        config.load()
        assert config.ssl is not None

        def fresh_context() -> ssl.SSLContext:
            return create_ssl_context(
                certfile=cert,
                keyfile=key,
                password=config.ssl_keyfile_password,
                ssl_version=config.ssl_version,
                cert_reqs=config.ssl_cert_reqs,
                ca_certs=config.ssl_ca_certs,
                ciphers=config.ssl_ciphers,
            )

        watcher.on_change.append(follow_in_ssl_context(config.ssl, fresh_context))
        return watcher

    def _note_certificate(self, pair: ServedPair) -> None:
        """Export a served certificate's expiry, and warn when it is close."""
        from zoo_gym.coordinator.tls import expiry_warning

        self.metrics.tls_expiry.set(pair.certificate.not_valid_after_utc.timestamp())
        assert self.config.tls_cert is not None
        if warning := expiry_warning(self.config.path(self.config.tls_cert), pair.certificate):
            log.warning("%s", warning)

    def serve(self, *, stay: bool = False) -> LoopStatus:
        """gRPC + REST + the round loop, until done or SIGINT/SIGTERM; returns how the loop ended.

        With `rounds = 0`, or `stay`, it keeps answering (outcomes, downloads, REST) after the loop
        ended, until a signal; `/health` then says why the loop ended.
        """
        from zoo_gym.coordinator.api.app import RestServer
        from zoo_gym.transport.grid import GrpcGrid
        from zoo_gym.transport.limits import RateLimits
        from zoo_gym.transport.mailbox import Mailbox
        from zoo_gym.transport.server import start_server

        signals = self._catch_signals()
        c = self.config
        clear_spool(c.path("spool"))
        rest = RestServer(self, c.rest_listen, control=self.control, metrics=self.metrics)
        watcher = self._serve_tls(rest) if c.tls_cert is not None else None
        mailbox = Mailbox()
        limits = RateLimits(**c.grpc_limits())
        grpc_server = start_server(
            self.backend,
            mailbox,
            address=c.listen,
            spool=c.path("spool"),
            tls=watcher.pem if watcher is not None else None,
            limits=limits,
        )
        log.info("REST API on %s://%s", "https" if watcher else "http", c.rest_listen)
        rest.start()
        if watcher is not None:
            watcher.start()
        loop = threading.Thread(
            target=self.run_loop, args=(GrpcGrid(mailbox),), name="rounds", daemon=True
        )
        try:
            loop.start()
            self._wait_for(lambda: not loop.is_alive() or self.stop.is_set(), signals, mailbox)
            if not self.stop.is_set() and (c.rounds == 0 or stay):
                ended = self.health.status()
                if ended.healthy:
                    log.info("%s; serving until stopped", ended.reason)
                else:
                    log.warning("%s; serving until stopped (/health answers 503)", ended.reason)
                self._wait_for(self.stop.is_set, signals, mailbox)
        finally:
            self._shut_down(loop, mailbox, grpc_server, rest, watcher)
        return self.health.status()

    def _catch_signals(self) -> list[int]:
        """Note SIGINT / SIGTERM for the main thread to act on (`_wait_for`); a second one ends
        the process at once. The handler takes no lock, so it cannot deadlock what it interrupts."""
        caught: list[int] = []

        def on_signal(signum: int, frame: FrameType | None) -> None:
            if caught:
                os.write(2, b"second signal: stopping at once\n")
                os._exit(128 + signum)
            caught.append(signum)

        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGTERM, on_signal)
        return caught

    def _wait_for(self, done: Callable[[], bool], signals: list[int], mailbox: Mailbox) -> None:
        """Sleep in short steps until `done()`; a signal caught meanwhile starts the stop."""
        while not done():
            if signals and not self.stop.is_set():
                name = signal.Signals(signals[0]).name
                log.info("stopping (%s): closing the open round, then the servers", name)
                self.health.set("stopping", "coordinator stopping")
                self.stop.set()
                mailbox.close()
            time.sleep(0.1)

    def _shut_down(
        self,
        loop: threading.Thread,
        mailbox: Mailbox,
        grpc_server: ServerHandle,
        rest: RestServer,
        watcher: CertificateWatcher | None,
    ) -> None:
        """Let the loop close its round (up to `LOOP_STOP_S`), stop the servers, sign the log."""
        began = time.monotonic()
        self.stop.set()
        mailbox.close()
        loop.join(LOOP_STOP_S)
        if loop.is_alive():
            reason = (
                f"the round loop did not stop within {LOOP_STOP_S:.0f} s (busy evaluating or "
                "aggregating); a round it left open is recorded aborted at the next start"
            )
            log.error("%s", reason)
            self.health.set("stuck", reason)
        if watcher is not None:
            watcher.stop()
        grpc_server.stop()
        rest.stop()
        if not loop.is_alive():
            self._sign_checkpoint()
        log.info("stopped in %.1f s", time.monotonic() - began)

    def _sign_checkpoint(self) -> None:
        """Sign the log's head unless the latest checkpoint already covers every entry."""
        with Session(self.engine) as session:
            stats = ledger.ledger_stats(session)
            if stats.entries > stats.checkpoint_size:
                head = self.sign_checkpoint(session)  # to checkpoint_copy too
                log.info("signed checkpoint at log size %d", head.size)
