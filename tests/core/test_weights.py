"""Model weights on disk: one file or Hugging Face shards, read and written the same way."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from zoo_gym.core.weights import (
    INDEX,
    WEIGHTS,
    WeightsError,
    load_weights,
    parse_size,
    save_weights,
    shard_files,
    shard_plan,
    weight_files,
)


def _state() -> dict[str, torch.Tensor]:
    """Four float32 tensors of 16, 16, 40 and 8 bytes."""
    return {
        "a": torch.arange(4, dtype=torch.float32),
        "b": torch.ones(2, 2),
        "c": torch.linspace(0, 1, 10),
        "d": torch.tensor([3.0, -1.0]),
    }


def _same(left: dict[str, torch.Tensor], right: dict[str, torch.Tensor]) -> bool:
    return left.keys() == right.keys() and all(torch.equal(left[k], right[k]) for k in left)


def test_weights_that_fit_are_one_file(tmp_path: Path) -> None:
    # Execute
    written = save_weights(_state(), tmp_path, shard_size=80)

    # Assert
    assert written == [WEIGHTS] == weight_files(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [WEIGHTS]
    assert _same(load_weights(tmp_path), _state())


def test_larger_weights_are_shards_with_an_index(tmp_path: Path) -> None:
    # Execute: 32 bytes a shard; c (40 bytes) is larger and goes alone
    written = save_weights(_state(), tmp_path, shard_size=32)

    # Assert
    shards = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert written == [INDEX, *shards] == weight_files(tmp_path)
    index = json.loads((tmp_path / INDEX).read_text())
    assert index == {
        "metadata": {"total_size": 80},
        "weight_map": {"a": shards[0], "b": shards[0], "c": shards[1], "d": shards[2]},
    }
    assert [p.name for p in shard_files(tmp_path)] == shards
    assert not (tmp_path / WEIGHTS).exists()
    assert _same(load_weights(tmp_path), _state())


def test_shard_plan_is_greedy_in_order() -> None:
    assert shard_plan({}, 8) == []
    assert shard_plan({"a": 8, "b": 1}, 8) == [["a"], ["b"]]
    assert shard_plan({"a": 9, "b": 9}, 8) == [["a"], ["b"]]
    assert shard_plan({"a": 3, "b": 5, "c": 1}, 8) == [["a", "b"], ["c"]]


def test_sizes_take_bytes_or_units() -> None:
    assert parse_size(12345) == 12345
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("1.5 MiB") == 3 << 19
    with pytest.raises(ValueError, match="not a size"):
        parse_size("5 parsecs")


def _sharded(directory: Path) -> dict[str, object]:
    save_weights(_state(), directory, shard_size=32)
    index: dict[str, object] = json.loads((directory / INDEX).read_text())
    return index


@pytest.mark.parametrize(
    ("shard", "message"),
    [
        ("../outside.safetensors", "must be plain file names"),
        ("/etc/passwd", "must be plain file names"),
        ("..", "must be plain file names"),
        (["a list"], "must be plain file names"),
        ("model-00009-of-00009.safetensors", "which is not in"),
    ],
)
def test_an_index_naming_a_file_it_may_not_is_one_line(
    tmp_path: Path, shard: object, message: str
) -> None:
    # Prepare
    directory = tmp_path / "model"
    directory.mkdir()
    (tmp_path / "outside.safetensors").write_bytes(b"")
    index = _sharded(directory)
    index["weight_map"] = {"a": shard}
    (directory / INDEX).write_text(json.dumps(index))

    # Execute + Assert
    with pytest.raises(WeightsError, match=message) as exc:
        load_weights(directory)
    assert "\n" not in str(exc.value)


def test_a_shard_that_links_outside_the_directory_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / "model"
    directory.mkdir()
    _sharded(directory)
    shard = directory / "model-00003-of-00003.safetensors"
    outside = tmp_path / "elsewhere.safetensors"
    shard.rename(outside)
    shard.symlink_to(outside)

    with pytest.raises(WeightsError, match="leads outside"):
        weight_files(directory)


def test_a_tensor_missing_from_its_shard_is_one_line(tmp_path: Path) -> None:
    index = _sharded(tmp_path)
    weight_map = index["weight_map"]
    assert isinstance(weight_map, dict)
    weight_map["e"] = weight_map["a"]
    (tmp_path / INDEX).write_text(json.dumps(index))

    with pytest.raises(WeightsError, match=r"maps 'e' to model-00001-of-00003\.safetensors"):
        load_weights(tmp_path)


@pytest.mark.parametrize("text", ["{", "{}", '{"weight_map": {}}', '{"weight_map": [1]}'])
def test_a_malformed_index_is_one_line(tmp_path: Path, text: str) -> None:
    _sharded(tmp_path)
    (tmp_path / INDEX).write_text(text)

    with pytest.raises(WeightsError) as exc:
        load_weights(tmp_path)
    assert str(exc.value).startswith(str(tmp_path / INDEX)) and "\n" not in str(exc.value)


def test_no_weights_or_both_layouts_are_refused(tmp_path: Path) -> None:
    with pytest.raises(WeightsError, match=r"has no model\.safetensors or"):
        weight_files(tmp_path)
    _sharded(tmp_path)
    save_file({"a": torch.zeros(1)}, tmp_path / WEIGHTS)
    with pytest.raises(WeightsError, match="holds both"):
        load_weights(tmp_path)


def test_hugging_face_loads_the_shards_and_we_load_its_shards(
    tiny_home_template: Path, tmp_path: Path
) -> None:
    # Prepare
    from transformers import AutoModelForCausalLM

    base = tiny_home_template / "base"
    state = load_weights(base)
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    ours.mkdir()
    for name in ("config.json", "generation_config.json"):
        (ours / name).write_bytes((base / name).read_bytes())

    # Execute: write shards of at most 100 kB; let Hugging Face read them and write its own
    written = save_weights(state, ours, shard_size=100_000)
    model = AutoModelForCausalLM.from_pretrained(ours, dtype=torch.float32)
    model.save_pretrained(theirs, max_shard_size="100KB")

    # Assert
    assert written[0] == INDEX and len(written) > 3
    loaded = model.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    assert (theirs / INDEX).exists() and len(shard_files(theirs)) > 3
    assert _same(load_weights(theirs), state)


def test_each_write_holds_one_shard_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: record the tensors each safetensors write is handed
    from zoo_gym.core import weights

    written: list[int] = []
    real = weights.save_file

    def recorded(tensors: dict[str, torch.Tensor], path: Path, **kwargs: object) -> None:
        written.append(sum(v.numel() * v.element_size() for v in tensors.values()))
        real(tensors, path, metadata={"format": "pt"})

    monkeypatch.setattr(weights, "save_file", recorded)

    # Execute
    save_weights(_state(), tmp_path, shard_size=32)

    # Assert: three writes, none over the shard size but the 40-byte tensor on its own
    assert written == [32, 40, 8]
