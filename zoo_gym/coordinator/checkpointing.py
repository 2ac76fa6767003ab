"""The coordinator's signature on the ledger: signed tree heads, and their copy elsewhere."""

from __future__ import annotations

import logging
from pathlib import Path

from zoo_gym import ledger
from zoo_gym.core.identity import Identity
from zoo_gym.ledger import Session

log = logging.getLogger(__name__)


class CheckpointSigner:
    """Signs the ledger's current tree head with the coordinator's key and appends every
    signed head to `copy_to` (the `checkpoint_copy` setting) when set."""

    def __init__(self, signer: Identity, copy_to: Path | None) -> None:
        self.signer = signer
        self.copy_to = copy_to

    @property
    def public_key(self) -> bytes:
        """The key contributors verify checkpoints with."""
        return self.signer.public_key

    def sign_checkpoint(self, session: Session) -> ledger.Checkpoint:
        """Sign the ledger's current tree head and append it to `copy_to`."""
        head = ledger.checkpoint(session, signer=self.signer)
        self.copy_checkpoint(head)
        return head

    def copy_checkpoint(self, head: ledger.Checkpoint | None) -> None:
        """Append `head` to `copy_to`, when set.

        A copy that cannot be written is logged, not raised: the checkpoint is signed and stored,
        and the round goes on; the operator repairs the copy's storage.
        """
        if self.copy_to is None or head is None:
            return
        try:
            ledger.append_checkpoint(
                self.copy_to, ledger.SignedCheckpoint.of(head, self.signer.public_key)
            )
        except OSError as exc:
            log.error(
                "checkpoint of size %d was not copied to %s (%s); fix checkpoint_copy's "
                "storage, the next checkpoint is copied again",
                head.size,
                self.copy_to,
                exc.strerror or exc,
            )
