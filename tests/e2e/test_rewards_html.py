"""The HTML reward statement renders in a real browser: `gym-client rewards --format html
--verify` runs as its own process against a coordinator's REST API on 127.0.0.1, and headless
Chromium takes a screenshot of the page it wrote.

The screenshot is kept under the test's tmp_path (its path is printed); with ZOO_GYM_ARTIFACTS
set it is also copied to test-artifacts/ at the repository root. Skipped only when no Chromium
binary is installed (Debian: apt-get install chromium; `.ci/run` does).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from sqlmodel import Session

from zoo_gym import ledger
from zoo_gym.client.state import LocalState
from zoo_gym.coordinator.api.app import RestServer
from zoo_gym.coordinator.config import load_config
from zoo_gym.coordinator.serve import api_services
from zoo_gym.coordinator.service import Coordinator
from zoo_gym.core.identity import Identity
from zoo_gym.simulation.demo import free_port

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
WIDTH, HEIGHT = 1200, 900
TEAL = np.array([0x2A, 0x9D, 0x8F]) / 255  # accepted rewards' bars in the plot
GREEN = np.array([0xE6, 0xF4, 0xEA]) / 255  # the "verified" banner


def browser() -> str | None:
    return next((found for name in BROWSERS if (found := shutil.which(name))), None)


def populate(co: Coordinator, alice: Identity) -> None:
    """Six rounds: paid, paid, rejected at intake, paid zero, paid, paid; then a checkpoint."""
    with Session(co.engine) as s:
        ledger.register_contributor(
            s, contributor_id=alice.contributor_id, public_key=alice.public_key, name="alice"
        )
        plan = [(0.3, "4.5"), (0.2, "3.25"), None, (-0.1, "0"), (0.4, "6"), (0.35, "5.125")]
        for number, paid in enumerate(plan, start=1):
            ledger.open_round(
                s, number=number, base_version="v0000", seed=number, aggregator="median", codec="bd"
            )
            ledger.record_submission(
                s,
                round_number=number,
                contributor_id=alice.contributor_id,
                nonce=f"n{number}",
                base_version="v0000",
                payload_sha256="ab" * 32,
                size_bytes=10,
                decision="rejected" if paid is None else "accepted",
                reason="payload hash does not match" if paid is None else "accepted at intake",
                epsilon=0.5,
            )
            if paid is not None:
                quality, amount = paid
                ledger.record_reward(
                    s,
                    round_number=number,
                    contributor_id=alice.contributor_id,
                    quality=quality,
                    amount=amount,
                    reputation_after=0.1 * number,
                    reason="" if quality > 0 else "harmful: validation loss went up",
                )
            ledger.close_round(s, number=number, status="published", metrics={})
        ledger.checkpoint(s, signer=co.signer)


@pytest.fixture
def served(tiny_home: Path, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A coordinator's REST API on 127.0.0.1 and alice's home (key, config, pinned key)."""
    co = Coordinator(load_config(tiny_home / "coordinator.toml"))
    home = tmp_path / "alice"
    (home / "state").mkdir(parents=True)
    alice = Identity.generate()
    alice.save(home / "client.key")
    (home / "client.toml").write_text('name = "alice"\nkey = "client.key"\n')
    LocalState(
        home / "state" / "state.json",
        "127.0.0.1:1",
        co.signer.public_key.hex(),
        alice.contributor_id,
    ).save()
    populate(co, alice)
    port = free_port()
    server = RestServer(api_services(co), f"127.0.0.1:{port}")
    server.start(wait_s=10)
    try:
        yield f"http://127.0.0.1:{port}", home
    finally:
        server.stop()
        co.engine.dispose()


def keep(screenshot: Path) -> None:
    print(f"screenshot: {screenshot}")
    if os.environ.get("ZOO_GYM_ARTIFACTS"):
        artifacts = ROOT / "test-artifacts"
        artifacts.mkdir(exist_ok=True)
        shutil.copy(screenshot, artifacts / screenshot.name)
        print(f"screenshot kept as {artifacts / screenshot.name}")


def near(image: np.ndarray, colour: np.ndarray, tolerance: float = 0.06) -> int:
    """How many pixels of `image` (H, W, 3) are within `tolerance` of `colour` per channel."""
    return int(np.all(np.abs(image - colour) <= tolerance, axis=-1).sum())


def test_html_statement_renders_in_headless_chromium(
    served: tuple[str, Path], tmp_path: Path
) -> None:
    exe = browser()
    if exe is None:
        pytest.skip("no Chromium binary on PATH (apt-get install chromium)")
    import matplotlib.image

    # Prepare: the statement, written by the real command in its own process
    url, home = served
    page, screenshot = tmp_path / "rewards.html", tmp_path / "rewards-report.png"
    command = [sys.executable, "-m", "zoo_gym.cli.client", "rewards", "--home", str(home)]
    options = ["--api", url, "--format", "html", "--verify", "--out", str(page)]
    written = subprocess.run(
        [*command, *options], capture_output=True, text=True, timeout=120, check=False
    )
    assert written.returncode == 0, written.stdout + written.stderr
    assert "5 reward(s) verified" in written.stderr

    # Execute
    shot = subprocess.run(
        [
            exe,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--hide-scrollbars",
            f"--user-data-dir={tmp_path / 'profile'}",
            f"--screenshot={screenshot}",
            f"--window-size={WIDTH},{HEIGHT}",
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )

    # Assert
    assert shot.returncode == 0 and screenshot.exists(), shot.stderr[-2000:]
    keep(screenshot)
    image = matplotlib.image.imread(screenshot)[..., :3]
    assert image.shape == (HEIGHT, WIDTH, 3)
    inked = np.any(image < 0.9, axis=-1).mean()
    assert 0.02 < inked < 0.6, f"{inked:.1%} of the page is not white"
    assert near(image, TEAL) > 2_000, "the plot's reward bars are not on the page"
    assert near(image, GREEN, tolerance=0.02) > 5_000, "the verified banner is not on the page"
