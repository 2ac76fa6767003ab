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
