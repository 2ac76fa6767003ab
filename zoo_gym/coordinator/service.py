"""A coordinator's parts, assembled from its configuration.

`Coordinator` builds and owns the ledger's engine, the model registry, intake (the backend the
gRPC server calls), the evaluator, the operators' round control, metrics and the loop's health,
and builds the strategy each round's policy asks for. The round loop (`rounds`) drives these
parts; `serve` puts them on the network; the REST API sees only the narrow services it needs
(`api.deps.ApiServices`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from zoo_gym import ledger
from zoo_gym.coordinator.admission import AdmissionPolicy
from zoo_gym.coordinator.backend import CoordinatorBackend
from zoo_gym.coordinator.checkpointing import CheckpointSigner
from zoo_gym.coordinator.config import CoordinatorConfig
from zoo_gym.coordinator.control import RoundControl
from zoo_gym.coordinator.evaluation import Evaluator
from zoo_gym.coordinator.liveness import LoopHealth
from zoo_gym.coordinator.metrics import CoordinatorMetrics
from zoo_gym.coordinator.registry import ModelRegistry
from zoo_gym.coordinator.strategy import ZooStrategy, resolve_device
from zoo_gym.core.delta import Layout
from zoo_gym.core.identity import Identity
from zoo_gym.core.phases import phase


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
    """The parts of one coordinator, built from `config` (its home directory's settings).

    `config` is the policy in force: `apply_policy` replaces it between rounds.
    """

    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config
        self.signer = Identity.load(config.path(config.signing_key))
        self.engine = ledger.open_database(config.ledger_url)
        self.registry = ModelRegistry(config.path("models"), self.signer)
        copy = config.checkpoint_copy
        self.checkpoints = CheckpointSigner(self.signer, config.path(copy) if copy else None)
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
        with phase("load", "evaluation model"):
            self.evaluator = Evaluator(
                self.registry.latest().directory,
                config.path(config.validation_data),
                max_length=config.training.max_length,
                device=resolve_device(config.device),  # scoring and the quality gate run there
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
            device=c.device,
            memory=c.aggregation_memory,
            seed=c.selection_seed,
        )
