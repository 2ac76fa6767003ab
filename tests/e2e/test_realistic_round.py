"""One round on a model of Qwen2.5-0.5B's size, served and joined by real processes.

Runs `bench/realistic_round.py` (random weights with Qwen2.5-0.5B's configuration, float32
shards, a coordinator and two contributors on 127.0.0.1, FFA-LoRA SFT with BitDelta) and
checks what it measured against the goals: each contributor's peak RSS at most 2.5x the
model's float32 bytes, the coordinator's at most 3x, the upload at least 14x smaller than
the bf16 update, and a published version written in shards that its signed manifest lists.
About 2 minutes on 2 cores; the three processes peak at about 11 GiB together.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from zoo_gym.core.weights import weight_files

BENCH = Path(__file__).resolve().parents[2] / "bench" / "realistic_round.py"

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_a_round_on_a_half_billion_parameter_model_stays_within_its_memory_goals(
    tmp_path: Path,
) -> None:
    # Execute
    work, result_file = tmp_path / "round", tmp_path / "result.json"
    subprocess.run(
        [
            *(sys.executable, str(BENCH), "--steps", "2", "--workdir", str(work), "--keep"),
            *("--json", str(result_file), "--timeout", "840"),
        ],
        check=True,
        timeout=900,
    )

    # Assert: every phase of every process reported, and the goals
    result = json.loads(result_file.read_text())
    phases = {(row["process"], row["phase"]) for row in result["phases"]}
    for client in ("client-0", "client-1"):
        assert {(client, p) for p in ("download", "load", "train", "encode", "upload")} <= phases
    coordinator = {"load", "evaluate", "decode", "aggregate", "score", "merge", "publish"}
    assert {("coordinator", p) for p in coordinator} <= phases
    assert result["model_fp32_bytes"] > 1.9e9
    assert result["contributor_peak_vs_fp32"] <= 2.5
    assert result["coordinator_peak_vs_fp32"] <= 3.0
    assert result["upload_smaller"] >= 14.0
    published = work / "coordinator" / "models" / "v0001"
    files = weight_files(published)
    assert len(files) >= 5  # the index and its shards
    listed = json.loads((published / "manifest.json").read_text())["files"]
    assert set(files) <= set(listed)
