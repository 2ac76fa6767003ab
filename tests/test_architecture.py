"""The dependency rules of DESIGN.md and the freshness of generated code."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_import_contracts_hold() -> None:
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert exe is not None, "import-linter is not installed (pip install -e .[dev])"
    result = subprocess.run([exe], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-4000:]


def test_generated_protobuf_code_is_fresh() -> None:
    result = subprocess.run(
        [sys.executable, "proto/generate.py", "--check"], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


FLOWER_INTERNALS = ("flwr.supercore", '"_message_id"', "_construct_messages", "TaskIdentity")


def test_flower_internals_are_used_in_one_adapter_only() -> None:
    adapter = ROOT / "zoo_gym" / "transport" / "flower_internals.py"
    users = {
        str(path.relative_to(ROOT))
        for path in (ROOT / "zoo_gym").rglob("*.py")
        if path != adapter and any(name in path.read_text() for name in FLOWER_INTERNALS)
    }
    assert users == set(), users
    assert all(name in adapter.read_text() for name in ('"_message_id"', "TaskIdentity"))
