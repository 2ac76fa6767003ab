"""Prometheus exposition of the coordinator's metrics (viewer key; see `zoo_gym.coordinator.metrics`)."""

from __future__ import annotations

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST

from zoo_gym.coordinator.api.deps import StateDep, ViewerDep

router = APIRouter(tags=["metrics"])


@router.get(
    "/metrics",
    operation_id="get_metrics",
    response_class=Response,
    responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text format"}},
)
def get_metrics(state: StateDep, viewer: ViewerDep) -> Response:
    """Round, submission, aggregation and ledger metrics in Prometheus text format."""
    return Response(state.services.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)
