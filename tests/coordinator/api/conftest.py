"""Fixtures: a real coordinator behind its REST app (see `api_world`)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from api_world import World, build_world


@pytest.fixture
def world(tiny_home: Path) -> Iterator[World]:
    built = build_world(tiny_home)
    yield built
    built.co.engine.dispose()


@pytest.fixture(scope="module")
def shared_world(
    tiny_home_template: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[World]:
    """One world per module, for tests that do not mind what the others in it wrote."""
    home = tmp_path_factory.mktemp("api") / "coordinator"
    shutil.copytree(tiny_home_template, home)
    built = build_world(home)
    yield built
    built.co.engine.dispose()
