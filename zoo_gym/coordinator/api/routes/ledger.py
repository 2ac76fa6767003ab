"""The Merkle log: entries, signed checkpoints, inclusion and consistency proofs, audit events.

Proofs follow RFC 9162 §2.1 and verify with `zoo_gym.core.merkle.verify_inclusion` and
`verify_consistency` against a checkpoint's root; hashes are hex.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Query, status

from zoo_gym import ledger
from zoo_gym.coordinator.api.deps import (
    AdminDep,
    ApiState,
    ReaderDep,
    SessionDep,
    StateDep,
    ViewerDep,
)
from zoo_gym.coordinator.api.schemas import (
    CheckpointSigned,
    ConsistencyProofPublic,
    InclusionProofPublic,
    LedgerPage,
)
from zoo_gym.ledger import AuditEvent, AuditEventPublic, Checkpoint, LogEntryPublic, Session
from zoo_gym.ledger.models import MAX_INT64

router = APIRouter(tags=["ledger"])

MAX_PAGE = 1000


def _signed(state: ApiState, head: Checkpoint) -> CheckpointSigned:
    return CheckpointSigned(
        **head.model_dump(), public_key=state.services.checkpoints.public_key.hex()
    )


@router.get("/ledger/entries", operation_id="list_ledger_entries", response_model=LedgerPage)
def list_ledger_entries(
    session: SessionDep,
    viewer: ViewerDep,
    start: Annotated[int, Query(ge=0, le=MAX_INT64)] = 0,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 100,
) -> LedgerPage:
    """Log entries `start`..`start + limit - 1` (canonical JSON records and their leaf hashes)."""
    entries = ledger.list_entries(session, start=start, limit=limit)
    return LedgerPage(
        size=ledger.log_size(session),
        start=start,
        limit=limit,
        entries=[LogEntryPublic.model_validate(e) for e in entries],
    )


@router.get("/ledger/checkpoint", operation_id="get_checkpoint", response_model=CheckpointSigned)
def get_checkpoint(state: StateDep, session: SessionDep, reader: ReaderDep) -> CheckpointSigned:
    """The latest signed tree head (size, root, Ed25519 signature)."""
    head = ledger.latest_checkpoint(session)
    if head is None:
        raise HTTPException(
            status.HTTP_404_NOT_FOUND, "no checkpoint yet; an admin can create one (POST)"
        )
    return _signed(state, head)


@router.post(
    "/ledger/checkpoint",
    operation_id="create_checkpoint",
    response_model=CheckpointSigned,
    status_code=status.HTTP_201_CREATED,
)
def create_checkpoint(state: StateDep, session: SessionDep, admin: AdminDep) -> CheckpointSigned:
    """Sign the log's current tree head now (also appended to `checkpoint_copy` when set)."""
    return _signed(state, state.services.checkpoints.sign_checkpoint(session))


def _default_size(session: Session, tree_size: int | None) -> int:
    if tree_size is not None:
        return tree_size
    head = ledger.latest_checkpoint(session)
    return head.size if head is not None else ledger.log_size(session)


@router.get(
    "/ledger/proofs/inclusion",
    operation_id="get_inclusion_proof",
    response_model=InclusionProofPublic,
)
def get_inclusion_proof(
    session: SessionDep,
    reader: ReaderDep,
    index: Annotated[int, Query(ge=0, le=MAX_INT64, description="log entry index")],
    tree_size: Annotated[
        int | None, Query(ge=1, le=MAX_INT64, description="default: the latest checkpoint's size")
    ] = None,
) -> InclusionProofPublic:
    """Audit path of entry `index` in the tree of the first `tree_size` entries."""
    size = _default_size(session, tree_size)
    if index >= size:
        raise HTTPException(  # 400: 422 is documented as FastAPI's validation error body
            400,
            f"entry {index} is not in a tree of size {size}; pass a larger tree_size "
            "or create a checkpoint",
        )
    try:
        proof = ledger.get_inclusion_proof(session, index=index, tree_size=size)
    except ValueError as exc:
        raise HTTPException(400, str(exc)) from None
    return InclusionProofPublic(
        index=proof.index,
        tree_size=proof.tree_size,
        leaf_hash=proof.leaf_hash.hex(),
        path=[p.hex() for p in proof.path],
        root=proof.root.hex(),
    )


@router.get(
    "/ledger/proofs/consistency",
    operation_id="get_consistency_proof",
    response_model=ConsistencyProofPublic,
)
def get_consistency_proof(
    session: SessionDep,
    reader: ReaderDep,
    old_size: Annotated[int, Query(ge=0, le=MAX_INT64)],
    new_size: Annotated[
        int | None, Query(ge=0, le=MAX_INT64, description="default: the latest checkpoint's size")
    ] = None,
) -> ConsistencyProofPublic:
    """Proof that the tree of `old_size` entries is a prefix of the tree of `new_size`."""
    size = _default_size(session, new_size)
    try:
        proof = ledger.get_consistency_proof(session, old_size=old_size, new_size=size)
    except ValueError as exc:
        raise HTTPException(400, str(exc)) from None
    return ConsistencyProofPublic(
        old_size=proof.old_size,
        new_size=proof.new_size,
        old_root=proof.old_root.hex(),
        new_root=proof.new_root.hex(),
        path=[p.hex() for p in proof.path],
    )


@router.get("/audit", operation_id="list_audit_events", response_model=list[AuditEventPublic])
def list_audit_events(
    session: SessionDep,
    viewer: ViewerDep,
    target: Annotated[
        str | None, Query(description="e.g. a contributor id, policy, rounds")
    ] = None,
) -> list[AuditEvent]:
    """Operator actions, oldest first: who changed what, and when."""
    return ledger.list_audit(session, target=target)
