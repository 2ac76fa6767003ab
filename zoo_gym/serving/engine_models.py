"""What `gym-serve` serves: the published versions under a models root, and their variants.

A models root is the coordinator's (`<root>/<version>/` holds a Hugging Face model directory and
its signed `manifest.json`; `<root>/variants/<V>-from-<P>.zgde` + `.json` are BitDelta variants
written by `gym-coordinator variant`). Every version is checked against the coordinator's public
key when one is given (signature and every file's SHA-256, `zoo_gym.core.manifest.read_verified`),
before any weight is read. Model ids are the version names; a variant's id is its file stem,
``<V>-from-<P>``.

A variant runs on its parent's weights, never merged: the parent's model is hooked once
(`zoo_gym.serving.variants.attach`) and each variant's rows add their 1-bit products to the
base's forward pass, so one batch mixes the parent's rows and rows of any of its variants. The
variants are read when a request first asks for them, into an LRU `VariantStore` per parent
(record, size and SHA-256 checked on every read) within `variant_memory` bytes: the server
starts without reading any (it checks each envelope's size against its record), and a variant
that fails its check fails the request that asked for it, in one line. A batch runs only as
many distinct variants as fit in those bytes together: a request for one more waits until rows
of the others end.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zoo_gym.core.manifest import MANIFEST, ManifestError, ModelManifest, read_verified
from zoo_gym.serving.variants import (
    DIRECTORY,
    RECORD_FORMAT,
    VariantStore,
    attach,
    variant_files,
)

log = logging.getLogger(__name__)

VERSION_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # a version directory's name
DEFAULT_VARIANT_MEMORY = 2 << 30  # bytes of loaded variants per served parent

Assign = Callable[[Sequence[str | None]], AbstractContextManager[Any]]


class ServingError(ValueError):
    """The models root, a version or a variant cannot be served (one line says why)."""


def _no_variants(rows: Sequence[str | None]) -> AbstractContextManager[Any]:
    return nullcontext()


@dataclass(eq=False)
class Weights:
    """One set of weights on one device; every row of a forward pass runs on it.

    `assign(rows)` is entered around each forward pass with one entry per batch row: the
    variant that row uses, or None for these weights as they are; `store` holds those
    variants (None: the weights run none).
    """

    model: nn.Module
    device: torch.device
    assign: Assign = _no_variants
    store: VariantStore | None = None


@dataclass(frozen=True)
class ServedModel:
    id: str
    directory: Path
    created: int  # seconds since the epoch
    tokenizer: Any
    weights: Weights
    context: int  # positions the model attends to: prompt + completion
    parent: str | None = None
    variant: str | None = None  # passed to `weights.assign` for this model's rows
    eos_ids: frozenset[int] = field(default_factory=frozenset)


def resolve_device(name: str) -> torch.device:
    """`cpu`, `cuda` or `cuda:N`; ServingError when CUDA is asked for and absent."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ServingError(f"--device {name!r} is not a device; use cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ServingError("--device cuda: no CUDA device is available here; use --device cpu")
    if device.type not in ("cpu", "cuda"):
        raise ServingError(f"--device {name!r}: only cpu and cuda are supported")
    return device


def published_versions(root: Path) -> list[str]:
    """Names of the version directories under `root` that hold a manifest, sorted."""
    if not root.is_dir():
        raise ServingError(f"{root} is not a directory; --models takes a coordinator's models root")
    found = [
        p.name for p in root.iterdir() if VERSION_NAME.fullmatch(p.name) and (p / MANIFEST).exists()
    ]
    return sorted(found)


def _manifest(directory: Path, coordinator_key: bytes | None) -> ModelManifest:
    if coordinator_key is None:
        return ModelManifest.from_bytes((directory / MANIFEST).read_bytes())
    return read_verified(directory, coordinator_key)


def _eos_ids(tokenizer: Any, model: nn.Module) -> frozenset[int]:
    ids = {tokenizer.eos_token_id}
    config_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids |= set(config_eos) if isinstance(config_eos, list) else {config_eos}
    return frozenset(int(i) for i in ids if i is not None)


def _context(model: nn.Module, tokenizer: Any) -> int:
    positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return int(positions or tokenizer.model_max_length)


def load_model(directory: Path, device: torch.device) -> tuple[nn.Module, Any]:
    """The causal LM (float32 on the CPU, bfloat16 on CUDA) and tokenizer of `directory`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype)
    model.to(device)  # type: ignore[arg-type]
    model.eval()  # type: ignore[no-untyped-call]
    return model, AutoTokenizer.from_pretrained(directory)


def load_versions(
    root: Path,
    *,
    coordinator_key: bytes | None,
    device: torch.device,
    only: Sequence[str] = (),
) -> dict[str, ServedModel]:
    """Every published version under `root` (or the ones named in `only`), verified first."""
    versions = published_versions(root)
    missing = sorted(set(only) - set(versions))
    if missing:
        raise ServingError(f"no published version {', '.join(missing)} under {root}")
    if not versions:
        raise ServingError(
            f"no published version under {root}; --models takes the directory that holds "
            "<version>/manifest.json (the coordinator's models/)"
        )
    if coordinator_key is None:
        log.warning("no coordinator key given: serving %s without checking signatures", root)
    served = {}
    for version in only or versions:
        directory = root / version
        manifest = _manifest(directory, coordinator_key)
        model, tokenizer = load_model(directory, device)
        served[version] = ServedModel(
            id=version,
            directory=directory,
            created=int(manifest.created_at),
            tokenizer=tokenizer,
            weights=Weights(model, device),
            context=_context(model, tokenizer),
            parent=manifest.parent,
            eos_ids=_eos_ids(tokenizer, model),
        )
    return served


def variant_records(root: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """(id, record) of each variant record under `root/variants`; ServingError for a bad one."""
    for path in sorted((root / DIRECTORY).glob("*.json")):
        try:
            record = json.loads(path.read_text())
            if record.get("format") != RECORD_FORMAT or record.get("codec") != "bitdelta":
                raise ServingError(
                    f"{path}: not a BitDelta variant record of format {RECORD_FORMAT}"
                )
            yield path.stem, record
        except (ValueError, AttributeError) as exc:
            if isinstance(exc, ServingError):
                raise
            raise ServingError(f"{path}: not a variant record ({exc})") from None


def variant_of(name: str, record: dict[str, Any], base: ServedModel) -> ServedModel:
    """The variant `name` (`<V>-from-<P>`), served on its parent's weights: its rows name V to
    the parent's `assign`."""
    version = record.get("version")
    if not isinstance(version, str) or name != f"{version}-from-{base.id}":
        raise ServingError(f"variant record {name}.json names version {version!r} of {base.id}")
    return ServedModel(
        id=name,
        directory=base.directory,
        created=base.created,
        tokenizer=base.tokenizer,
        weights=base.weights,
        context=base.context,
        parent=base.id,
        variant=version,
        eos_ids=base.eos_ids,
    )


def _mix_variants(base: ServedModel, root: Path, memory: int) -> VariantStore:
    """Hook `base`'s model so that its batches take rows of its variants (module docstring);
    returns the store they are read into."""
    store = VariantStore(root, base.id, memory, device=base.weights.device)
    base.weights.assign = attach(base.weights.model, store).assign
    base.weights.store = store
    return store


def load_models(
    root: Path,
    *,
    coordinator_key: bytes | None = None,
    device: str = "cpu",
    only: Sequence[str] = (),
    variants: bool = True,
    variant_memory: int = DEFAULT_VARIANT_MEMORY,
) -> dict[str, ServedModel]:
    """The published versions under `root` and, with `variants`, each variant whose parent is
    served, within `variant_memory` bytes of loaded variants per parent. ManifestError (from
    verification) and ServingError say what is wrong in one line."""
    served = load_versions(
        root, coordinator_key=coordinator_key, device=resolve_device(device), only=only
    )
    stores: dict[str, VariantStore] = {}
    for name, record in variant_records(root) if variants else ():
        base = served.get(str(record.get("parent")))
        if base is None or base.variant is not None:
            log.warning("variant %s: its parent %s is not served; skipped", name, record["parent"])
            continue
        if base.id not in stores:
            stores[base.id] = _mix_variants(base, root, variant_memory)
        served[name] = variant = variant_of(name, record, base)
        _check_size(variant_files(root, str(variant.variant), base.id)[0], record)
        stores[base.id].expect(str(variant.variant), int(record["size"]))
    return served


def _check_size(envelope: Path, record: dict[str, Any]) -> None:
    """`envelope` is there, of its record's size (its SHA-256 is checked when it is first
    read)."""
    size = envelope.stat().st_size if envelope.is_file() else None
    if not isinstance(record.get("size"), int) or size != record["size"]:
        found = "missing" if size is None else f"{size} bytes"
        raise ServingError(
            f"{envelope} is {found}; its record says {record.get('size')} bytes: "
            "write the variant again or remove its record"
        )


__all__ = [
    "ManifestError",
    "ServedModel",
    "ServingError",
    "Weights",
    "load_models",
    "resolve_device",
]
