"""A model directory's weights: one `model.safetensors`, or an index and its shards.

Both are the Hugging Face layouts, so `AutoModelForCausalLM.from_pretrained` reads what
`save_weights` writes and `load_weights` reads what `save_pretrained` writes:

- one file, `model.safetensors`, when the weights fit in one shard;
- `model.safetensors.index.json` (``{"metadata": {"total_size": bytes}, "weight_map":
  {tensor: file}}``) and the shards it names, `model-00001-of-0000N.safetensors`, ...

A directory whose weights are missing, whose index is malformed, names a file outside the
directory or a missing one, or maps a tensor to a shard that lacks it raises `WeightsError`
with one line saying what is wrong.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
DEFAULT_SHARD_SIZE = 5 * 10**9  # bytes; Hugging Face's default max_shard_size, "5GB"

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*")


class WeightsError(ValueError):
    """A model directory's weights are missing or inconsistent."""


def parse_size(value: int | str) -> int:
    """Bytes in `value`: an int, or a string with a unit as Hugging Face writes them.

    >>> parse_size("5GB"), parse_size("2GiB"), parse_size("500 kb"), parse_size(1024)
    (5000000000, 2147483648, 500000, 1024)
    """
    if isinstance(value, int):
        return value
    match = _SIZE.fullmatch(value.lower())
    if match is None or match[2] not in _UNITS:
        raise ValueError(f"{value!r} is not a size; write bytes (1000000) or e.g. '2GB', '512MiB'")
    return int(float(match[1]) * _UNITS[match[2]])


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def shard_plan(sizes: Mapping[str, int], shard_size: int) -> list[list[str]]:
    """Tensor names grouped into shards, in order: a shard takes tensors while their bytes stay
    within `shard_size`; a tensor larger than that gets a shard of its own (as Hugging Face does).

    >>> shard_plan({"a": 4, "b": 4, "c": 9, "d": 1}, 8)
    [['a', 'b'], ['c'], ['d']]
    """
    shards: list[list[str]] = []
    used = 0
    for name, size in sizes.items():
        if not shards or used + size > shard_size:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def shard_name(index: int, count: int) -> str:
    """The file name of shard `index` (from 0) of `count`, as `save_pretrained` names it."""
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def read_index(directory: Path) -> dict[str, str]:
    """The validated weight map (tensor -> shard file name) of `directory`'s index."""
    path = directory / INDEX
    try:
        weight_map = json.loads(path.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise WeightsError(f"{path} is unreadable or has no weight_map ({exc})") from None
    if not isinstance(weight_map, dict) or not weight_map:
        raise WeightsError(f"{path}: weight_map must map tensor names to shard files")
    root = directory.resolve()
    checked: set[str] = set()
    for file in weight_map.values():
        if not isinstance(file, str) or Path(file).name != file or file in ("", ".", ".."):
            raise WeightsError(f"{path} names {file!r}; shards must be plain file names")
        if file in checked:
            continue
        checked.add(file)
        shard = directory / file
        if not shard.resolve().is_relative_to(root):
            raise WeightsError(f"{path} names {file!r}, which leads outside {directory}")
        if not shard.is_file():
            raise WeightsError(f"{path} names {file!r}, which is not in {directory}")
    return dict(weight_map)


def weight_files(directory: Path) -> list[str]:
    """Names of the files that hold `directory`'s weights: the single file, or the index and
    the shards it names."""
    single, index = (directory / WEIGHTS).is_file(), (directory / INDEX).is_file()
    if single and index:
        raise WeightsError(f"{directory} holds both {WEIGHTS} and {INDEX}; keep one of them")
    if single:
        return [WEIGHTS]
    if index:
        return [INDEX, *sorted(set(read_index(directory).values()))]
    raise WeightsError(
        f"{directory} has no {WEIGHTS} or {INDEX}; "
        "save the model with save_pretrained(..., safe_serialization=True)"
    )


def shard_files(directory: Path) -> list[Path]:
    """The safetensors files of `directory`'s weights (no index), each once."""
    return [directory / name for name in weight_files(directory) if name != INDEX]


def _load_shard(path: Path, names: list[str], index: Path) -> Iterator[tuple[str, torch.Tensor]]:
    try:
        with safe_open(str(path), framework="pt") as handle:
            present = set(handle.keys())
            for name in names:
                if name not in present:
                    raise WeightsError(f"{index} maps {name!r} to {path.name}, which lacks it")
                yield name, handle.get_tensor(name)
    except SafetensorError as exc:
        raise WeightsError(f"{path} is not a readable safetensors file ({exc})") from None


def load_weights(directory: Path) -> dict[str, torch.Tensor]:
    """The state dict of `directory` (name -> tensor), from one file or from every shard."""
    files = weight_files(directory)
    if files == [WEIGHTS]:
        try:
            return load_file(directory / WEIGHTS)
        except SafetensorError as exc:
            raise WeightsError(f"{directory / WEIGHTS} is not readable ({exc})") from None
    by_shard: dict[str, list[str]] = {}
    for name, file in read_index(directory).items():
        by_shard.setdefault(file, []).append(name)
    state: dict[str, torch.Tensor] = {}
    for file, names in sorted(by_shard.items()):
        state.update(_load_shard(directory / file, names, directory / INDEX))
    return state


def save_weights(
    state_dict: Mapping[str, torch.Tensor],
    directory: Path,
    *,
    shard_size: int = DEFAULT_SHARD_SIZE,
) -> list[str]:
    """Write `state_dict` into `directory` (which holds no weights yet); the names written.

    One `model.safetensors` when the tensors' bytes fit in `shard_size`, else shards of at most
    `shard_size` bytes each (a larger tensor alone) and the index. One shard is serialized at a
    time, so memory beyond `state_dict` stays within about one shard.
    """
    if shard_size < 1:
        raise ValueError(f"shard_size must be a positive number of bytes, not {shard_size}")
    plan = shard_plan({k: tensor_bytes(v) for k, v in state_dict.items()}, shard_size)
    if len(plan) <= 1:
        _save(state_dict, plan[0] if plan else [], directory / WEIGHTS)
        return [WEIGHTS]
    weight_map: dict[str, str] = {}
    for i, names in enumerate(plan):
        file = shard_name(i, len(plan))
        _save(state_dict, names, directory / file)
        weight_map.update(dict.fromkeys(names, file))
    total = sum(tensor_bytes(v) for v in state_dict.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return [INDEX, *(shard_name(i, len(plan)) for i in range(len(plan)))]


def _save(state_dict: Mapping[str, torch.Tensor], names: list[str], path: Path) -> None:
    save_file({k: state_dict[k].contiguous() for k in names}, path, metadata={"format": "pt"})
