"""What contributors download: the published versions' signed manifests and files."""

from __future__ import annotations

from pathlib import Path

from zoo_gym.coordinator.registry import ModelRegistry
from zoo_gym.core.protocol import RequestError


def current_version(registry: ModelRegistry) -> str:
    """The newest published version ("" before the first)."""
    try:
        return registry.latest().version
    except FileNotFoundError:
        return ""


def manifest(registry: ModelRegistry, version: str) -> tuple[bytes, bytes]:
    """(canonical manifest bytes, coordinator signature) of a published version."""
    try:
        directory = registry.directory(version)
    except KeyError:
        raise _not_published(version) from None
    return (directory / "manifest.json").read_bytes(), (directory / "manifest.sig").read_bytes()


def model_file(registry: ModelRegistry, version: str, name: str) -> Path:
    """Path of one file its manifest lists of a published version."""
    try:
        published = registry.get(version)
    except KeyError:
        raise _not_published(version) from None
    if name not in published.manifest.files:
        raise RequestError("NOT_FOUND", f"{name!r} is not a file of {version}")
    return published.directory / name


def _not_published(version: str) -> RequestError:
    return RequestError("NOT_FOUND", f"model version {version[:64]!r} is not published here")
