"""The operator's invitation code travels from `gym-client join --invite` (or client.toml) to the
coordinator's registration, on first contact and on every re-registration after an outage."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from zoo_gym.cli.client import app
from zoo_gym.client.link import Link
from zoo_gym.client.session import JoinError
from zoo_gym.core.identity import Identity
from zoo_gym.transport.client import TransportError

sys.path.insert(0, str(Path(__file__).parents[1] / "transport"))
from wire import Wire, build_wire

runner = CliRunner()


@pytest.fixture
def wire(tiny_home: Path) -> Iterator[Wire]:
    built = build_wire(tiny_home, limits=None)
    yield built
    built.close()


def test_a_link_sends_its_invite_on_first_contact_and_after_an_outage(
    wire: Wire, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = wire.co.backend
    seen: list[str] = []
    register = backend.register

    def spy(**kw: Any) -> Any:
        seen.append(kw["invite"])
        return register(**kw)

    monkeypatch.setattr(backend, "register", spy)
    link = Link(wire.client(Identity.generate()), "me", reconnect_for_s=30, invite="K3Y-2026")

    first = link.register()
    back = link.reconnect(TransportError("connection dropped", transient=True))

    assert first.status == "active" and back
    assert seen == ["K3Y-2026", "K3Y-2026"]


def joined_invite(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *flags: str) -> str:
    """The invite `gym-client join` hands its link, with client.toml saying "FROM-FILE"."""
    home = tmp_path / "alice"
    assert runner.invoke(app, ["init", "--home", str(home), "--name", "alice"]).exit_code == 0
    with (home / "client.toml").open("a") as fh:
        fh.write('invite = "FROM-FILE"\n')
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"instruction": "2+2?", "input": "", "output": "4"}) + "\n")
    invites: list[str] = []

    def first_contact(link: Link) -> None:
        invites.append(link.invite)
        raise JoinError("stopped at first contact")

    monkeypatch.setattr(Link, "register", first_contact)
    args = ["join", "127.0.0.1:1", "--home", str(home), "--data", str(data), *flags]
    result = runner.invoke(app, args)
    assert result.exit_code == 1 and "stopped at first contact" in result.output, result.output
    return invites[0]


def test_join_takes_the_invite_from_client_toml_and_the_flag_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from_file = joined_invite(tmp_path / "a", monkeypatch)
    from_flag = joined_invite(tmp_path / "b", monkeypatch, "--invite", "FROM-FLAG")

    assert from_file == "FROM-FILE"
    assert from_flag == "FROM-FLAG"
