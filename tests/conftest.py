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


SHARD_SIZE = 100_000  # bytes; the tiny model (about 450 kB) takes five or more shards


@pytest.fixture(scope="session")
def sharded_base(tiny_home_template: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny base as Hugging Face saves a large model: an index and shards of 100 kB."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = tiny_home_template / "base"
    base = tmp_path_factory.mktemp("sharded") / "base"
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    model.save_pretrained(base, max_shard_size=SHARD_SIZE)
    AutoTokenizer.from_pretrained(source).save_pretrained(base)
    return base


@pytest.fixture(scope="session")
def sharded_home_template(
    sharded_base: Path, tiny_home_template: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """A coordinator home started from `sharded_base` that publishes shards of 100 kB."""
    from zoo_gym.coordinator.setup import init_home

    home = tmp_path_factory.mktemp("sharded-template") / "coordinator"
    init_home(
        home,
        tiny=False,
        base_model=sharded_base,
        validation=tiny_home_template / "validation.jsonl",
        settings=f"shard_size = {SHARD_SIZE}\n",
    )
    return home


@pytest.fixture
def sharded_home(sharded_home_template: Path, tmp_path: Path) -> Path:
    home = tmp_path / "coordinator"
    shutil.copytree(sharded_home_template, home)
    return home
