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
    from zoo_gym.coordinator.rounds import RoundSummary

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

    def serve(self, *, stay: bool = False) -> None:
        """gRPC + REST + the round loop, until done or SIGINT/SIGTERM."""
        from zoo_gym.coordinator.api.app import RestServer
        from zoo_gym.coordinator.tls import check_server_files, expiry_warning
        from zoo_gym.transport.grid import GrpcGrid
        from zoo_gym.transport.limits import RateLimits
        from zoo_gym.transport.mailbox import Mailbox
        from zoo_gym.transport.server import start_server

        c = self.config
        tls = None
        rest = RestServer(self, c.rest_listen, control=self.control, metrics=self.metrics)
        if c.tls_cert is not None and c.tls_key is not None:
            cert, key = c.path(c.tls_cert), c.path(c.tls_key)
            certificate = check_server_files(cert, key)
            tls = (cert.read_bytes(), key.read_bytes())
            self.metrics.tls_expiry.set(certificate.not_valid_after_utc.timestamp())
            if warning := expiry_warning(cert, certificate):
                log.warning("%s", warning)
            # REST serves HTTPS with the same certificate (uvicorn builds its context at start)
            rest.server.config.ssl_certfile = str(cert)
            rest.server.config.ssl_keyfile = str(key)
        mailbox = Mailbox()
        limits = RateLimits(
            c.grpc_rate_per_s,
            c.grpc_burst,
            c.contributor_rate_per_s,
            c.contributor_burst,
            c.max_concurrent_per_peer,
        )
        grpc_server = start_server(
            self.backend, mailbox, address=c.listen, spool=c.path("spool"), tls=tls, limits=limits
        )
        log.info("REST API on %s://%s", "https" if tls else "http", c.rest_listen)
        rest.start()

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
            grpc_server.stop()
            rest.stop()
