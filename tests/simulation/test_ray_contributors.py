"""Where a virtual contributor's own state lives between its rounds under `--engine ray`."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("ray", reason="Flower's simulation engine needs the `sim` extra (ray)")

from zoo_gym.simulation.ray_contributors import DirectoryStates, Seat


def test_directory_states_give_each_contributor_back_its_own_files(tmp_path: Path) -> None:
    # Prepare: two contributors' homes on two actors; one has no residual yet
    states = DirectoryStates(tmp_path / "storage")
    first, second = Seat("median-none-00", 0), Seat("median-none-00", 1)
    home = tmp_path / "actor-a"
    home.mkdir()
    (home / "state.json").write_text('{"privacy": 1}')
    (home / "feedback.safetensors").write_bytes(b"\x01\x02")
    other = tmp_path / "actor-b"
    other.mkdir()
    (other / "state.json").write_text('{"privacy": 2}')

    # Execute: both keep their state; fresh homes (another actor, another node) restore it
    states.keep(first.key, home)
    states.keep(second.key, other)
    restored = {seat.key: tmp_path / f"fresh-{seat.client}" for seat in (first, second)}
    for key, fresh in restored.items():
        fresh.mkdir()
        states.restore(key, fresh)

    # Assert: each got its own files, nothing of the other's, no temporary files left behind
    mine, theirs = restored[first.key], restored[second.key]
    assert (mine / "state.json").read_text() == '{"privacy": 1}'
    assert (mine / "feedback.safetensors").read_bytes() == b"\x01\x02"
    assert (theirs / "state.json").read_text() == '{"privacy": 2}'
    assert not (theirs / "feedback.safetensors").exists()
    kept = sorted(p.relative_to(states.root).as_posix() for p in states.root.rglob("*.*"))
    assert kept == [
        "median-none-00/client-0/feedback.safetensors",
        "median-none-00/client-0/state.json",
        "median-none-00/client-1/state.json",
    ]
