"""The coordinator process: composition root for `gym-coordinator serve`.

It wires the ledger, the model registry, intake, the strategy and the round
loop, then serves gRPC (contributors), REST (operators) and runs the ServerApp
over the gRPC Grid until the configured rounds are done or it is stopped.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING

from flwr.app import Context, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from zoo_gym import ledger
from zoo_gym.coordinator.backend import CoordinatorBackend
from zoo_gym.coordinator.config import CoordinatorConfig
from zoo_gym.coordinator.control import RoundControl
from zoo_gym.coordinator.evaluation import Evaluator
from zoo_gym.coordinator.metrics import CoordinatorMetrics
from zoo_gym.coordinator.registry import ModelRegistry
from zoo_gym.coordinator.strategy import ZooStrategy
from zoo_gym.core.delta import Layout
from zoo_gym.core.identity import Identity

if TYPE_CHECKING:
    import ssl

    from zoo_gym.coordinator.api.app import RestServer
    from zoo_gym.coordinator.rounds import RoundSummary
    from zoo_gym.coordinator.tls import CertificateWatcher, ServedPair

log = logging.getLogger(__name__)
SERVERAPP_NODE_ID = 0


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
            require_approval=config.require_approval,
            metrics=self.metrics,
            max_submissions_per_round=config.max_submissions_per_round,
        )
        self.evaluator = Evaluator(
            self.registry.latest().directory,
            config.path(config.validation_data),
            max_length=config.training.max_length,
        )
        self.stop = threading.Event()

    def apply_policy(self, config: CoordinatorConfig) -> None:
        """Use `config` from the next round on (a policy change staged through the REST API)."""
        self.config = config
        self.backend.require_approval = config.require_approval
        self.backend.max_upload_bytes = config.max_upload_bytes
        self.backend.clock_skew_s = config.clock_skew_s
        self.backend.max_submissions_per_round = config.max_submissions_per_round

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
        )

    def run(self, grid: object, *, on_round: Callable[[RoundSummary], None] | None = None) -> None:
        """Run the ServerApp on `grid` in this thread."""
        from zoo_gym.coordinator.rounds import make_server_app

        TaskIdentity.run_id = 1
        TaskIdentity.node_id = SERVERAPP_NODE_ID
        TaskIdentity.task_id = 1
        context = Context(
            run_id=1, node_id=SERVERAPP_NODE_ID, node_config={}, state=RecordDict(), run_config={}
        )
        make_server_app(self, on_round=on_round)(grid, context)  # type: ignore[arg-type]

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

    def serve(self, *, stay: bool = False) -> None:
        """gRPC + REST + the round loop, until done or SIGINT/SIGTERM."""
        from zoo_gym.coordinator.api.app import RestServer
        from zoo_gym.transport.grid import GrpcGrid
        from zoo_gym.transport.limits import RateLimits
        from zoo_gym.transport.mailbox import Mailbox
        from zoo_gym.transport.server import start_server

        c = self.config
        rest = RestServer(self, c.rest_listen, control=self.control, metrics=self.metrics)
        watcher = self._serve_tls(rest) if c.tls_cert is not None else None
        mailbox = Mailbox()
        limits = RateLimits(
            c.grpc_rate_per_s,
            c.grpc_burst,
            c.contributor_rate_per_s,
            c.contributor_burst,
            c.max_concurrent_per_peer,
        )
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

        def _stop(signum: int, frame: FrameType | None) -> None:
            log.info("stopping (signal %d)", signum)
            self.stop.set()

        signal.signal(signal.SIGINT, _stop)
        signal.signal(signal.SIGTERM, _stop)
        try:
            self.run(GrpcGrid(mailbox))
            log.info("round loop finished")
            if c.rounds > 0 and not stay:
                return
            self.stop.wait()  # keep answering outcome, download and REST calls until stopped
        finally:
            if watcher is not None:
                watcher.stop()
            grpc_server.stop()
            rest.stop()
