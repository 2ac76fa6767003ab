"""BitDelta variants of a served base, loaded packed and run many to a batch without merging.

A variant ``models/variants/<V>-from-<P>.zgde`` (written by ``gym-coordinator variant V``) is a
BitDelta envelope of V - P over every tensor, with a JSON record beside it (format, version,
parent, codec, group size, sha256, size). `load_variant` checks the record against the served
base P and the envelope against the record, and keeps each weight matrix as packed signs and
group scales (`PackedTensor`, 1.125 bits per value with float16 scales of 128 values: about
1/14 of the bf16 model; on the CPU in the layout its kernel reads, `binary.kernel_layout`),
vectors (norms, biases) as well. `VariantStore` loads variants on
demand and evicts the least recently used beyond a memory budget.

`attach(model)` hooks a Hugging Face causal LM so that one batch mixes rows of several variants
(and of the base): ``with mixed.assign([None, "v1", ...])`` (or `PackedVariant` objects, one per
row of input_ids) makes the following forward passes, `generate` included, compute

- every `nn.Linear` (the LM head too, tied or not) once for the whole batch, ``x @ W^T + b``,
  plus for the rows of variant v the 1-bit product ``x_v @ D_v^T`` from the packed bits, added
  into those rows of the output in place (`zoo_gym.serving.binary.accumulate`, with each
  layer's operands prepared once per `assign`), and v's bias delta;
- every `nn.Embedding` once, plus for each row of v the delta rows of its looked-up tokens,
  decoded from those rows' signs and scales only (`zoo_gym.serving.binary.add_rows`: one call
  for every variant of the batch);
- every other module whose own parameters a variant changes (RMSNorm, LayerNorm: vectors of
  the hidden size) with each row's own parameters: the variant keeps those deltas packed too,
  decoded once per `assign`, and the module runs once with per-row weights (B, 1, ..., h)
  broadcast over the batch (put in place of its own by a pre-hook, in every `assign`, once a
  first run has shown that its forward broadcasts them), or, where it does not, once per
  variant on its rows.

Row r then computes exactly what the merged model P + decode(variant) computes, up to float
rounding (sums in another order). Beam search reorders rows and is not supported; sampling
and greedy decoding with a KV cache are.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from zoo_gym.compression import EnvelopeError, inspect_envelope
from zoo_gym.compression.envelope import bitdelta_parts, unpacks_together
from zoo_gym.serving import binary
from zoo_gym.serving.packed import PackedTensor

logger = logging.getLogger(__name__)

RECORD_FORMAT = 1  # the record `gym-coordinator variant` writes
DIRECTORY = "variants"
_SCALE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


class VariantError(ValueError):
    """A variant is missing, corrupt, or not a variant of the served base."""


@dataclass(frozen=True)
class PackedVariant:
    """A loaded variant: matrices (`packed`) and vectors (norms, biases: `vectors`), each as
    packed signs and scales."""

    version: str
    parent: str
    packed: dict[str, PackedTensor]
    vectors: dict[str, PackedTensor]
    shapes: dict[str, tuple[int, ...]] = field(repr=False)

    @property
    def nbytes(self) -> int:
        """Bytes held: packed signs and scales."""
        return sum(p.nbytes for p in (*self.packed.values(), *self.vectors.values()))


def variant_files(models_root: Path, version: str, parent: str) -> tuple[Path, Path]:
    """(envelope, JSON record) of the variant `version`-from-`parent` under the models root."""
    stem = models_root / DIRECTORY / f"{version}-from-{parent}"
    return stem.with_suffix(".zgde"), stem.with_suffix(".json")


def _missing(models_root: Path, version: str, base: str) -> VariantError:
    others = sorted(p.stem for p in (models_root / DIRECTORY).glob(f"{version}-from-*.json"))
    if others:
        parents = ", ".join(name.split("-from-", 1)[1] for name in others)
        return VariantError(
            f"variant {version} is a delta of {parents}, not of the served base {base}; "
            f"write one against {base} with `gym-coordinator variant`"
        )
    return VariantError(
        f"no variant {version} of {base} under {models_root / DIRECTORY}; "
        f"write it with `gym-coordinator variant {version}`"
    )


def _read_record(path: Path, version: str, base: str) -> dict[str, Any]:
    try:
        record = json.loads(path.read_text())
        if not isinstance(record, dict):
            raise ValueError("not an object")
    except (OSError, ValueError) as exc:
        raise VariantError(
            f"{path} is not a readable variant record ({exc}); write it again"
        ) from None
    if record.get("format") != RECORD_FORMAT or record.get("codec") != "bitdelta":
        raise VariantError(
            f"{path}: format {record.get('format')!r} / codec {record.get('codec')!r} is not a "
            f"BitDelta variant record of format {RECORD_FORMAT}"
        )
    if record.get("version") != version or record.get("parent") != base:
        raise VariantError(
            f"{path} describes {record.get('version')}-from-{record.get('parent')}, "
            f"not {version}-from-{base}; write the variant again"
        )
    return record


def load_variant(
    models_root: Path, version: str, *, base: str, device: torch.device | str = "cpu"
) -> PackedVariant:
    """Read the variant `version` of the served `base` (record, envelope, sha256), keeping
    matrices packed. Raises `VariantError` with one line for a missing, corrupt or
    mismatched variant."""
    envelope, record_path = variant_files(models_root, version, base)
    if not record_path.is_file():
        raise _missing(models_root, version, base)
    record = _read_record(record_path, version, base)
    try:
        payload = envelope.read_bytes()
    except OSError as exc:
        raise VariantError(f"cannot read {envelope} ({exc}); write the variant again") from None
    sha256 = record.get("sha256")
    if len(payload) != record.get("size") or not isinstance(sha256, str):
        raise VariantError(
            f"{envelope} does not match its record (size or sha256): it is corrupt or was "
            "replaced; write the variant again"
        )
    try:
        packed, vectors, shapes = _unpack_envelope(payload, envelope, sha256)
    except EnvelopeError as exc:
        raise VariantError(f"{envelope}: {exc}; write the variant again") from None
    packed = {name: binary.kernel_layout(p.to(device)) for name, p in packed.items()}
    vectors = {name: p.to(device) for name, p in vectors.items()}
    return PackedVariant(version, base, packed, vectors, shapes)


def _unpack_envelope(
    payload: bytes, path: Path, sha256: str
) -> tuple[dict[str, PackedTensor], dict[str, PackedTensor], dict[str, tuple[int, ...]]]:
    """Matrices and 1-D tensors as `PackedTensor` (own copies of signs and stored scales),
    and every tensor's shape; the payload's SHA-256 must be `sha256` (its record's)."""
    header = inspect_envelope(payload, max_elements=8 * len(payload), sha256=sha256)
    if not unpacks_together(header):
        raise VariantError(f"{path} is not a BitDelta envelope of one group size")
    signs, _ = bitdelta_parts(payload, header)  # validates scales and padding
    scale_dtype = _SCALE_DTYPES[header.spec.scale_dtype]
    group = header.spec.group_size
    packed: dict[str, PackedTensor] = {}
    vectors: dict[str, PackedTensor] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for section, bits in zip(header.sections, signs, strict=True):
        name, shape = section.spec.name, tuple(section.spec.shape)
        start, stop = section.scales_offset, section.scales_offset + section.scales_nbytes
        scales = _owned(payload[start:stop]).view(scale_dtype)
        tensor = PackedTensor(shape, bits.clone(), scales, group)
        shapes[name] = shape
        (packed if len(shape) >= 2 else vectors)[name] = tensor
    return packed, vectors, shapes


def _owned(data: bytes) -> Tensor:
    """A writable uint8 tensor holding a copy of `data`."""
    if not data:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


_Stamp = tuple[tuple[int, int, int] | None, ...]


def _stamp(paths: Sequence[Path]) -> _Stamp:
    """(inode, size, modification time in ns) of each of `paths`, None for a missing one."""
    stamps: list[tuple[int, int, int] | None] = []
    for path in paths:
        try:
            st = path.stat()
        except OSError:
            stamps.append(None)
        else:
            stamps.append((st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(stamps)


class VariantStore:
    """Variants of one served base, loaded on demand and kept within `budget_bytes` by
    evicting the least recently used. Thread-safe; `hits`, `loads` and `evictions` count.

    A variant is read outside the store's lock, so variants in memory are handed out while
    another is read. `reserve` pins a variant for a request that will use it, if it fits in
    the budget beside those pinned already; a pinned variant is never evicted (the serving
    engine pins every variant its batch runs, so it never reads one again while its rows
    run), and `release` unpins it. Without pins the store is a plain LRU cache: a batch keeps
    the variants it was given alive until it ends, so an evicted variant's memory returns
    once no batch uses it.

    A variant whose read failed is refused again with the same line, without reading it, until
    its envelope or record changes (another inode, size or modification time) or
    `retry_failed_s` pass (a read error may pass): asking again and again for a damaged variant
    costs a `stat`, not a read and a hash of its file.
    """

    def __init__(
        self,
        models_root: Path,
        base: str,
        budget_bytes: int,
        *,
        device: torch.device | str = "cpu",
        retry_failed_s: float = 60.0,
    ) -> None:
        if budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be positive, not {budget_bytes}")
        self.models_root, self.base, self.budget_bytes = models_root, base, budget_bytes
        self.device, self.retry_failed_s = device, retry_failed_s
        self._cache: OrderedDict[str, PackedVariant] = OrderedDict()
        self._sizes: dict[str, int] = {}  # bytes of each variant read, or expected until then
        self._pins: Counter[str] = Counter()  # requests using each pinned variant
        # why each variant's last read failed, the state of its files then, and when
        self._failed: dict[str, tuple[_Stamp, str, float]] = {}
        self._lock = threading.Lock()
        self.nbytes = self.hits = self.loads = self.evictions = self.failed_reads = 0

    def __len__(self) -> int:
        return len(self._cache)

    def __contains__(self, version: object) -> bool:
        return version in self._cache

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {
                "loaded": len(self._cache),
                "pinned": len(self._pins),
                "bytes": self.nbytes,
                "budget_bytes": self.budget_bytes,
                "hits": self.hits,
                "loads": self.loads,
                "evictions": self.evictions,
                "failed_reads": self.failed_reads,
            }

    def expect(self, version: str, nbytes: int) -> None:
        """Take `nbytes` as `version`'s size until it is read (its record's size)."""
        with self._lock:
            self._sizes.setdefault(version, nbytes)

    def fits(self, versions: Collection[str]) -> bool:
        """Whether `versions` fit in the budget together; one neither read nor `expect`ed is
        taken to be as large as the largest known (the variants of one base hold the same
        tensors)."""
        with self._lock:
            return self._fits(versions)

    def _fits(self, versions: Collection[str]) -> bool:
        largest = max(self._sizes.values(), default=0)
        return sum(self._sizes.get(v, largest) for v in versions) <= self.budget_bytes

    def reserve(self, version: str) -> bool:
        """Pin `version` for one more user if it is pinned already, if nothing is, or if it
        fits in the budget beside the variants pinned (`fits`); False leaves nothing pinned.
        One too large for the budget on its own is refused when it is read (`get`)."""
        with self._lock:
            crowded = self._pins and version not in self._pins
            if crowded and not self._fits([*self._pins, version]):
                return False
            self._pins[version] += 1
            return True

    def release(self, version: str) -> None:
        """Unpin `version` for one user (`reserve`); it stays in memory until evicted."""
        with self._lock:
            self._pins[version] -= 1
            if self._pins[version] <= 0:
                del self._pins[version]

    def get(self, version: str) -> PackedVariant:
        """The variant `version`, from memory or read (evicting others to fit the budget)."""
        with self._lock:
            cached = self._cache.get(version)
            if cached is not None:
                self._cache.move_to_end(version)
                self.hits += 1
                return cached
        stamp = _stamp(variant_files(self.models_root, version, self.base))
        refused = self._refused(version, stamp)
        if refused is not None:
            raise VariantError(refused)
        try:
            variant = self._read(version)
        except VariantError as exc:
            with self._lock:
                self._failed[version] = (stamp, str(exc), time.monotonic())
                self.failed_reads += 1
            raise
        with self._lock:
            self._failed.pop(version, None)
            cached = self._cache.get(version)
            if cached is not None:  # read by another caller meanwhile: theirs is kept
                self._cache.move_to_end(version)
                return cached
            self.loads += 1
            self._cache[version] = variant
            self._sizes[version] = variant.nbytes
            self.nbytes += variant.nbytes
            self._evict()
            return variant

    def _refused(self, version: str, stamp: _Stamp) -> str | None:
        """Why `version`'s last read failed, where its files are as they were then and
        `retry_failed_s` have not passed since; else None."""
        with self._lock:
            failed = self._failed.get(version)
        if failed is None:
            return None
        was, why, at = failed
        return why if was == stamp and time.monotonic() - at < self.retry_failed_s else None

    def _read(self, version: str) -> PackedVariant:
        variant = load_variant(self.models_root, version, base=self.base, device=self.device)
        if variant.nbytes > self.budget_bytes:
            raise VariantError(
                f"variant {version} takes {variant.nbytes} bytes, more than the budget of "
                f"{self.budget_bytes}; raise the variant memory budget"
            )
        return variant

    def _evict(self) -> None:
        """Drop the least recently used variants that are not pinned until the rest fit."""
        for name in [n for n in self._cache if n not in self._pins]:
            if self.nbytes <= self.budget_bytes:
                return
            self.nbytes -= self._cache.pop(name).nbytes
            self.evictions += 1


@dataclass
class _Rows:
    """One `assign`: the batch size, the distinct variants, and the rows of each (sorted)."""

    batch: int
    variants: list[PackedVariant]
    order: Tensor  # (R,) rows that use a variant, grouped by variant
    starts: list[int]  # variant k owns order[starts[k] : starts[k + 1]]
    vectors: dict[str, Tensor] = field(default_factory=dict)  # (B, ...) per-row deltas
    # per module (by id) and input rank: what its vector hook does (`_VectorPlan`), made
    # on the first step of an `assign` and reused by the next
    plans: dict[tuple[int, int], _VectorPlan] = field(default_factory=dict)
    biases: dict[tuple[str, int, torch.dtype], Tensor | None] = field(default_factory=dict)
    prepared: dict[str, binary.Operands] = field(default_factory=dict)  # by weight name
    positions: dict[int, tuple[Tensor, list[int]]] = field(default_factory=dict)
    # modules running with per-row parameters put in by their pre-hook, innermost last, with
    # their own parameters to put back
    swapped: list[tuple[nn.Module, dict[str, Any]]] = field(default_factory=list)

    def restore_last(self) -> None:
        """Give the innermost module running with per-row parameters its own back."""
        module, saved = self.swapped.pop()
        module._parameters.update(saved)

    def restore(self) -> None:
        """Give every module still running with per-row parameters its own back."""
        while self.swapped:
            self.restore_last()

    def operands(self, name: str) -> binary.Operands:
        """The variants' packed weights `name`, prepared for the kernel once per `assign`."""
        if name not in self.prepared:
            self.prepared[name] = binary.operands([v.packed[name] for v in self.variants])
        return self.prepared[name]

    def flat(self, per_row: int) -> tuple[Tensor, list[int]]:
        """The rows of a (B * per_row, ...) input that use a variant, grouped by variant
        (R * per_row,), and where each variant's rows start among them."""
        if per_row not in self.positions:
            offsets = torch.arange(per_row, device=self.order.device)
            rows = (self.order.view(-1, 1) * per_row + offsets).view(-1)
            self.positions[per_row] = (rows, [start * per_row for start in self.starts])
        return self.positions[per_row]

    def row_deltas(self, name: str, like: Tensor) -> Tensor | None:
        """(B, *shape) float32 deltas of the vector `name` per row (zero for base rows), or
        None when no variant of the batch changes it."""
        if name not in self.vectors:
            if not any(name in v.vectors for v in self.variants):
                return None
            rows = torch.zeros(self.batch, *like.shape, device=like.device)
            for k, variant in enumerate(self.variants):
                delta = variant.vectors.get(name)
                if delta is not None:
                    rows[self.order[self.starts[k] : self.starts[k + 1]]] = delta.decode()
            self.vectors[name] = rows
        return self.vectors[name]


@dataclass
class _VectorPlan:
    """What the vector hook of one module does for an `assign`: nothing (no variant of the
    batch changes its parameters), one run with the per-row parameters `params` broadcast
    over the batch, or (`params` None) one run per variant."""

    changed: bool
    params: dict[str, Tensor] | None = None


def _canonical_names(model: nn.Module) -> dict[int, str]:
    """The state-dict name of every parameter by identity: a tied parameter (an LM head that
    shares the embedding) gets the name it is saved under, its first."""
    names: dict[int, str] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), name)
    return names


class MixedModel:
    """A causal LM whose batch rows may each use a different variant of its weights (module
    docstring). Made by `attach`; one `assign` at a time (not for concurrent forwards)."""

    def __init__(self, model: nn.Module, store: VariantStore | None = None) -> None:
        self.model, self.store = model, store
        names = _canonical_names(model)
        self.shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
        self._rows: _Rows | None = None
        self._inside = False  # a module re-run with per-row parameters: hooks stand aside
        # (id(module), input ndim) whose forward has given the output's shape with per-row
        # parameters broadcast: from then on, in any `assign`, they are put in ahead of its run
        self._broadcasting: set[tuple[int, int]] = set()
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        for module in model.modules():
            own = {attr: names[id(p)] for attr, p in module.named_parameters(recurse=False)}
            if not own:
                continue
            if isinstance(module, nn.Linear):
                hook = self._linear_hook(own["weight"], own.get("bias"))
            elif isinstance(module, nn.Embedding):
                hook = self._embedding_hook(own["weight"])
            else:
                hook = self._vector_hook(own)
                pre = module.register_forward_pre_hook(self._vector_pre_hook(own))
                self._handles.append(pre)
            self._handles.append(module.register_forward_hook(hook))

    def detach(self) -> None:
        """Remove the hooks: the model computes the base alone again."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    @contextmanager
    def assign(self, rows: Sequence[PackedVariant | str | None]) -> Iterator[MixedModel]:
        """Within the block, batch row r uses ``rows[r]``: a variant, a version name (looked
        up in the store) or None for the base."""
        if self._rows is not None:
            raise RuntimeError("assign is already active on this model; nest no assignments")
        self._rows = plan = self._plan(rows)
        try:
            yield self
        finally:
            plan.restore()  # a forward that raised left them in
            self._rows = None

    def _resolve(self, row: PackedVariant | str) -> PackedVariant:
        if isinstance(row, PackedVariant):
            return row
        if self.store is None:
            raise VariantError(f"row asks for variant {row!r} by name, but no store is attached")
        return self.store.get(row)

    def _plan(self, rows: Sequence[PackedVariant | str | None]) -> _Rows:
        by_variant: dict[int, list[int]] = {}
        variants: dict[int, PackedVariant] = {}
        for r, row in enumerate(rows):
            if row is None:
                continue
            variant = self._resolve(row)
            if variant.shapes != self.shapes:
                raise VariantError(
                    f"variant {variant.version} holds other tensors than the served model; "
                    f"it was written against another base than {variant.parent}'s weights"
                )
            variants.setdefault(id(variant), variant)
            by_variant.setdefault(id(variant), []).append(r)
        order = [r for key in variants for r in by_variant[key]]
        starts = [0]
        for key in variants:
            starts.append(starts[-1] + len(by_variant[key]))
        device = next(self.model.parameters()).device
        index = torch.tensor(order, dtype=torch.long, device=device)
        return _Rows(len(rows), list(variants.values()), index, starts)

    def _active(self, batch: int) -> _Rows | None:
        rows = self._rows
        if rows is None or self._inside or not rows.variants:
            return None
        if batch != rows.batch:
            raise ValueError(
                f"the batch has {batch} rows but assign was given {rows.batch}; "
                "give one entry per row of input_ids"
            )
        return rows

    def _linear_hook(self, weight: str, bias: str | None) -> Any:
        def hook(module: nn.Linear, args: tuple[Tensor, ...], output: Tensor) -> Tensor | None:
            rows = self._active(output.shape[0])
            if rows is None:
                return None
            x = args[0]
            output = output.contiguous()
            flat, starts = rows.flat(x[0].numel() // x.shape[-1])  # rows x positions
            biases = None if bias is None else _row_biases(rows, bias, module.bias, output)
            added = binary.accumulate(
                output.view(-1, output.shape[-1]),
                x.reshape(-1, x.shape[-1]),
                flat,
                rows.operands(weight),
                starts,
                bias=None if biases is None else biases.view(rows.batch, -1),
            )
            if biases is not None and not added:  # (B, 1, ..., out), zero for base rows
                output.add_(biases)
            return output

        return hook

    def _embedding_hook(self, weight: str) -> Any:
        def hook(module: nn.Module, args: tuple[Tensor, ...], output: Tensor) -> Tensor | None:
            rows = self._active(output.shape[0])
            if rows is None:
                return None
            flat, starts = rows.flat(args[0][0].numel())  # rows x positions
            output = output.contiguous()
            binary.add_rows(
                output.view(-1, output.shape[-1]),
                args[0].reshape(-1),
                flat,
                rows.operands(weight),
                starts,
            )
            return output

        return hook

    def _vector_pre_hook(self, own: dict[str, str]) -> Any:
        def pre_hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            """Where `module`'s forward broadcasts per-row parameters (learned by
            `_vector_hook`), put this assign's in place of its own for this run: it runs once."""
            if not args or not isinstance(args[0], Tensor):
                return
            key = (id(module), args[0].ndim)
            rows = self._active(args[0].shape[0])
            if rows is None or key not in self._broadcasting:
                return
            plan = rows.plans.get(key)
            if plan is None:
                plan = rows.plans[key] = self._vector_plan(module, own, rows, args[0])
            if plan.params is None:  # unchanged, or changed by matrices: the hook sees to it
                return
            mine = module._parameters
            rows.swapped.append((module, {name: mine[name] for name in plan.params}))
            mine.update(plan.params)  # type: ignore[arg-type]

        return pre_hook

    def _vector_hook(self, own: dict[str, str]) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
            rows = self._rows
            if rows is not None and rows.swapped and rows.swapped[-1][0] is module:
                rows.restore_last()  # it ran with the per-row parameters: output is final
                return None
            if not isinstance(output, Tensor) or not args or not isinstance(args[0], Tensor):
                return None
            rows = self._active(output.shape[0])
            if rows is None:
                return None
            key = (id(module), args[0].ndim)
            plan = rows.plans.get(key)
            if plan is None:
                plan = rows.plans[key] = self._vector_plan(module, own, rows, args[0])
            if not plan.changed:
                return None
            if plan.params is not None:
                result = self._broadcast(module, plan.params, args)
                if result is not None and result.shape == output.shape:
                    self._broadcasting.add(key)  # from the next run on, put in ahead of it
                    return result
                plan.params = None  # this forward does not broadcast them: per variant
            return self._per_variant(module, own, rows, args, output)

        return hook

    def _vector_plan(
        self, module: nn.Module, own: dict[str, str], rows: _Rows, x: Tensor
    ) -> _VectorPlan:
        """The plan of a module's vector hook for this `assign` (`_VectorPlan`): its per-row
        parameters (B, 1, ..., *shape), made once, where every changed one is a vector delta."""
        changed = [
            n for n in own.values() if any(n in v.vectors or n in v.packed for v in rows.variants)
        ]
        if not changed:
            return _VectorPlan(False)
        if any(n in v.packed for v in rows.variants for n in changed):
            return _VectorPlan(True)
        params = {}
        for attr, name in own.items():
            base = getattr(module, attr)
            deltas = rows.row_deltas(name, base)
            if deltas is not None:
                shape = (rows.batch,) + (1,) * (x.ndim - 1 - base.ndim) + tuple(base.shape)
                params[attr] = base + deltas.view(shape).to(base.dtype)
        return _VectorPlan(True, params)

    def _call(self, module: nn.Module, params: dict[str, Tensor], args: tuple[Any, ...]) -> Any:
        """`module` run with `params` in place of its own parameters of those names (put in
        and taken out again around the call), without these hooks."""
        own = module._parameters
        saved = {name: own[name] for name in params}
        self._inside = True
        try:
            own.update(params)  # type: ignore[arg-type]
            return module(*args)
        finally:
            own.update(saved)
            self._inside = False

    def _broadcast(
        self, module: nn.Module, params: dict[str, Tensor], args: tuple[Any, ...]
    ) -> Tensor | None:
        """One run with per-row vectors (B, 1, ..., *shape); None where the forward does not
        broadcast them."""
        try:
            result = self._call(module, params, args)
        except RuntimeError:
            return None
        return result if isinstance(result, Tensor) else None

    def _per_variant(
        self,
        module: nn.Module,
        own: dict[str, str],
        rows: _Rows,
        args: tuple[Any, ...],
        output: Tensor,
    ) -> Tensor:
        """The module run once per variant on its rows, with that variant's merged parameters."""
        for k, variant in enumerate(rows.variants):
            params = {}
            for attr, name in own.items():
                base = getattr(module, attr)
                delta = variant.vectors.get(name) or variant.packed.get(name)
                if delta is not None:
                    params[attr] = base + delta.decode().to(base.dtype)
            if params:
                mine = rows.order[rows.starts[k] : rows.starts[k + 1]]
                picked = (args[0].index_select(0, mine), *args[1:])
                output[mine] = self._call(module, params, picked)
        return output


def _row_biases(rows: _Rows, name: str, base: Tensor, output: Tensor) -> Tensor | None:
    """The bias deltas of `name` per row (B, 1, ..., out) in the output's dtype, made once per
    `assign` and rank; None where no variant of the batch changes the bias."""
    key = (name, output.ndim, output.dtype)
    if key not in rows.biases:
        deltas = rows.row_deltas(name, base)
        shape = (rows.batch,) + (1,) * (output.ndim - 2) + (base.shape[-1],)
        rows.biases[key] = None if deltas is None else deltas.view(shape).to(output.dtype)
    return rows.biases[key]


def attach(model: nn.Module, store: VariantStore | None = None) -> MixedModel:
    """Hook `model` (a causal LM holding the served base's weights) so that batches mix
    variants (module docstring); `store` resolves variants given by name in `assign`."""
    return MixedModel(model, store)
