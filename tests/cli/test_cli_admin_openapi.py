"""`gym-coordinator admin openapi`: the API's description, fetched with a key."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cli_server import Served


def test_openapi_prints_the_description_with_a_viewer_key(served: Served) -> None:
    result = served.admin_cli("openapi", token=served.viewer)

    assert result.exit_code == 0, result.output
    assert "/rounds/{number}/abort" in json.loads(result.stdout)["paths"]


def test_openapi_writes_a_file(served: Served, tmp_path: Path) -> None:
    target = tmp_path / "openapi.json"
    result = served.admin_cli("openapi", "--output", str(target))

    assert result.exit_code == 0, result.output
    assert json.loads(target.read_text())["info"]["title"] == "zoo-gym coordinator"


def test_openapi_without_a_token_is_one_line(served: Served, tmp_path: Path) -> None:
    from cli_server import gym

    refused = gym("admin", "--url", served.url, "openapi")
    unwritable = served.admin_cli("openapi", "-o", str(tmp_path / "missing" / "openapi.json"))

    assert refused.exit_code == 1
    assert refused.output.strip().startswith("error: not authenticated:")
    assert len(refused.output.strip().splitlines()) == 1
    assert unwritable.exit_code == 1 and "cannot write" in unwritable.output
