"""The coordinator as the transport sees it (`zoo_gym.transport.backend.FederationBackend`).

`CoordinatorBackend` composes the parts that each do one job: registration under the admission
policy (`admission`), signed calls (`authentication`), downloads (`downloads`), intake of
submissions against the open round (`intake`) and decisions read back (`outcomes`). The
settings an operator changes between rounds are attributes here, read by the parts as they
work.
"""

from __future__ import annotations

from pathlib import Path

from flwr.app import RecordDict

from zoo_gym.coordinator import downloads, outcomes
from zoo_gym.coordinator.admission import AdmissionPolicy, KeyAdmission
from zoo_gym.coordinator.authentication import authenticate
from zoo_gym.coordinator.intake import Intake, OpenRound
from zoo_gym.coordinator.metrics import CoordinatorMetrics
from zoo_gym.coordinator.registry import ModelRegistry
from zoo_gym.coordinator.replay import NonceCache
from zoo_gym.core.identity import Identity, contributor_id, node_id
from zoo_gym.core.protocol import Outcome, Registration, SignedSubmission, Verdict
from zoo_gym.ledger import Engine


class CoordinatorBackend:
    def __init__(
        self,
        *,
        engine: Engine,
        registry: ModelRegistry,
        signer: Identity,
        payload_dir: Path,
        max_upload_bytes: int,
        clock_skew_s: float = 300.0,
        require_approval: bool = False,
        metrics: CoordinatorMetrics | None = None,
        max_submissions_per_round: int = 3,
        admission: AdmissionPolicy | None = None,
        nonces: NonceCache | None = None,
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.registry = registry
        self.signer = signer
        self.payload_dir = payload_dir
        self.clock_skew_s = clock_skew_s
        # single use of each signed call; remembered as long as its timestamp passes check_clock
        self.nonces = nonces or NonceCache(clock_skew_s)
        self.keys = KeyAdmission(engine, AdmissionPolicy() if admission is None else admission)
        if require_approval:
            self.keys.require_approval = True
        self.intake = Intake(
            engine=engine,
            payload_dir=payload_dir,
            max_upload_bytes=max_upload_bytes,
            max_submissions_per_round=max_submissions_per_round,
            metrics=metrics,
        )

    # -- settings, held by the parts that use them ---------------------------
    @property
    def admission(self) -> AdmissionPolicy:
        return self.keys.policy

    @admission.setter
    def admission(self, policy: AdmissionPolicy) -> None:
        self.keys.policy = policy

    @property
    def require_approval(self) -> bool:
        """Whether new keys wait for an operator (admission "approval")."""
        return self.keys.require_approval

    @require_approval.setter
    def require_approval(self, value: bool) -> None:
        self.keys.require_approval = value

    @property
    def open_round(self) -> OpenRound | None:
        """The round being collected (None between rounds)."""
        return self.intake.open_round

    @open_round.setter
    def open_round(self, value: OpenRound | None) -> None:
        self.intake.open_round = value

    @property
    def max_upload_bytes(self) -> int:
        return self.intake.max_upload_bytes

    @max_upload_bytes.setter
    def max_upload_bytes(self, value: int) -> None:
        self.intake.max_upload_bytes = value

    @property
    def max_submissions_per_round(self) -> int:
        return self.intake.max_submissions_per_round

    @max_submissions_per_round.setter
    def max_submissions_per_round(self, value: int) -> None:
        self.intake.max_submissions_per_round = value

    # -- identity -------------------------------------------------------------
    def register(
        self,
        *,
        public_key: bytes,
        name: str,
        timestamp_ms: int,
        signature: bytes,
        invite: str = "",
        peer: str | None = None,
    ) -> Registration:
        """Register a key under the admission policy; a known key is answered as it stands."""
        status = self.keys.register(
            public_key=public_key,
            name=name,
            timestamp_ms=timestamp_ms,
            signature=signature,
            invite=invite,
            peer=peer,
            clock_skew_s=self.clock_skew_s,
        )
        return Registration(
            contributor_id(public_key),
            node_id(public_key),
            status,
            self.current_version(),
            self.signer.public_key,
        )

    def authenticate(
        self,
        *,
        method: str,
        contributor_id: str,
        timestamp_ms: int,
        nonce: bytes,
        digest: str,
        signature: bytes,
    ) -> int:
        """Check a signed call and spend its nonce; the caller's node id."""
        return authenticate(
            self.engine,
            self.nonces,
            clock_skew_s=self.clock_skew_s,
            method=method,
            contributor_id=contributor_id,
            timestamp_ms=timestamp_ms,
            nonce=nonce,
            digest=digest,
            signature=signature,
        )

    # -- models -----------------------------------------------------------------
    def current_version(self) -> str:
        return downloads.current_version(self.registry)

    def manifest(self, version: str) -> tuple[bytes, bytes]:
        return downloads.manifest(self.registry, version)

    def model_file(self, version: str, name: str) -> Path:
        return downloads.model_file(self.registry, version, name)

    # -- submissions --------------------------------------------------------------
    def receive(
        self, sub: SignedSubmission, payload: Path, content: RecordDict, *, node_id: int
    ) -> tuple[Verdict, RecordDict]:
        return self.intake.receive(sub, payload, content, node_id=node_id)

    def refuse(self, sub: SignedSubmission, reason: str) -> Verdict:
        return self.intake.refuse(sub, reason)

    def payload_path(self, sha256: str) -> Path:
        return self.intake.payload_path(sha256)

    def outcome(self, contributor_id: str, round_number: int) -> Outcome:
        return outcomes.outcome(self.engine, contributor_id, round_number)
