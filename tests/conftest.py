"""Shared fixtures: a tiny coordinator home built once per session."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import settings

# CI replays the same examples on every run, so a red build always names a reproducible case;
# local runs draw new examples each time (ZOO_FUZZ_EXAMPLES raises the handler fuzz's count).
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)
if not torch.cuda.is_available():
    # Triton kernels run in the interpreter on CPU; the variable must be set before any
    # module (peft, bitsandbytes, ours) imports Triton and decorates kernels.
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_home_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A coordinator home made by `init_home(tiny=True)` (copied per test)."""
    from zoo_gym.coordinator.setup import init_home

    home = tmp_path_factory.mktemp("template") / "coordinator"
    init_home(home, tiny=True, settings="")
    return home


@pytest.fixture
def tiny_home(tiny_home_template: Path, tmp_path: Path) -> Path:
    home = tmp_path / "coordinator"
    shutil.copytree(tiny_home_template, home)
    return home
