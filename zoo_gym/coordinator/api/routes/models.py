"""Published base models: versions, signed manifests, and the files themselves."""

from __future__ import annotations

import base64
import hashlib
import json
from typing import Any

from fastapi import APIRouter, HTTPException, status
from fastapi.responses import FileResponse

from zoo_gym import ledger
from zoo_gym.coordinator.api.deps import ApiState, SessionDep, StateDep, ViewerDep
from zoo_gym.coordinator.api.schemas import ManifestPublic, ModelSummary
from zoo_gym.coordinator.registry import Published
from zoo_gym.core.manifest import MANIFEST, SIGNATURE, ManifestError

router = APIRouter(prefix="/models", tags=["models"])

FILE_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "content": {"application/octet-stream": {}},
        "description": "the file; `Repr-Digest` and `ETag` carry its SHA-256 from the manifest",
    }
}


def _published(state: ApiState, version: str) -> Published:
    """The published `version`; only names the registry lists, so no path can escape it."""
    registry = state.services.registry
    if version not in registry.versions():
        raise HTTPException(
            status.HTTP_404_NOT_FOUND, f"model version {version!r} is not published"
        )
    try:
        return registry.get(version)
    except (KeyError, ManifestError) as exc:
        raise HTTPException(
            status.HTTP_404_NOT_FOUND, f"model version {version!r}: {exc}"
        ) from None


@router.get("", operation_id="list_models", response_model=list[ModelSummary])
def list_models(state: StateDep, session: SessionDep, viewer: ViewerDep) -> list[ModelSummary]:
    """Every published base version, oldest first."""
    recorded = {m.version: m for m in ledger.list_model_versions(session)}
    out = []
    for version in state.services.registry.versions():
        published = _published(state, version)
        manifest = published.manifest
        row = recorded.get(version)
        out.append(
            ModelSummary(
                version=version,
                parent=manifest.parent,
                round=manifest.round,
                aggregator=manifest.aggregator,
                contributors=len(manifest.contributors),
                files=len(manifest.files),
                size_bytes=sum(f.size for f in manifest.files.values()),
                manifest_sha256=hashlib.sha256(manifest.to_bytes()).hexdigest(),
                created_at=manifest.created_at,
                published_at=row.published_at if row else None,
                metrics=manifest.metrics,
                epsilon=manifest.epsilon,
            )
        )
    return out


@router.get("/{version}/manifest", operation_id="get_model_manifest", response_model=ManifestPublic)
def get_model_manifest(state: StateDep, viewer: ViewerDep, version: str) -> ManifestPublic:
    """The signed manifest of `version`: every file with its size and SHA-256."""
    published = _published(state, version)
    data = (published.directory / MANIFEST).read_bytes()
    return ManifestPublic(
        version=version,
        manifest=json.loads(data),
        manifest_sha256=hashlib.sha256(data).hexdigest(),
        signature=(published.directory / SIGNATURE).read_bytes().hex(),
    )


@router.get(
    "/{version}/files/{name}",
    operation_id="download_model_file",
    response_class=FileResponse,
    responses=FILE_RESPONSES,
)
def download_model_file(
    state: StateDep, viewer: ViewerDep, version: str, name: str
) -> FileResponse:
    """Stream one file of `version`; only files the signed manifest lists are served."""
    published = _published(state, version)
    entry = published.manifest.files.get(name)
    missing = HTTPException(status.HTTP_404_NOT_FOUND, f"{name!r} is not a file of {version}")
    if entry is None:  # only names the signed manifest lists reach the file system
        raise missing
    directory = published.directory.resolve()
    path = (published.directory / name).resolve()
    if path.parent != directory or not path.is_file():
        raise missing
    digest = base64.b64encode(bytes.fromhex(entry.sha256)).decode()
    return FileResponse(
        path,
        media_type="application/octet-stream",
        filename=name,
        headers={"ETag": f'"{entry.sha256}"', "Repr-Digest": f"sha-256=:{digest}:"},
    )
