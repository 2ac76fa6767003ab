"""The coordinator as the transport sees it.

The gRPC servicer and the loopback Grid call these methods; the coordinator
implements them. Everything here speaks domain types (zoo_gym.core.protocol),
never protobuf, so the coordinator does not depend on the wire format.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from flwr.app import RecordDict

from zoo_gym.core.protocol import Outcome, Registration, SignedSubmission, Verdict


class FederationBackend(Protocol):
    max_upload_bytes: int

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
        """Register a key (idempotent for a known key) under the admission policy; `peer` is the
        caller's network address (None for a caller in this process). Raises RequestError."""

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
        """Check a signed call and spend its nonce; return the caller's node id.

        Raises RequestError, also for a call without a nonce and for a nonce already spent.
        """

    def current_version(self) -> str: ...

    def manifest(self, version: str) -> tuple[bytes, bytes]:
        """(canonical manifest bytes, coordinator signature). Raises RequestError."""

    def model_file(self, version: str, name: str) -> Path:
        """Path of one file of a published version. Raises RequestError."""

    def receive(
        self, submission: SignedSubmission, payload: Path, content: RecordDict, *, node_id: int
    ) -> tuple[Verdict, RecordDict]:
        """Validate and record a submission whose payload was spooled to `payload`; `content` is
        the rest of the ClientApp's reply (its training metrics).

        Returns the verdict and the content of the reply Message the ServerApp will see: an
        `IntakeResult` record under SUBMISSION (naming the stored payload by its hash) beside
        the training metrics.
        """

    def refuse(self, submission: SignedSubmission, reason: str) -> Verdict:
        """Record a rejection decided before the payload was read."""

    def outcome(self, contributor_id: str, round_number: int) -> Outcome: ...
