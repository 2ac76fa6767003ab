"""What every command prints goes out as written."""

from __future__ import annotations

import pytest

from zoo_gym.cli.common import console


def test_hex_with_colons_is_not_turned_into_emoji(capsys: pytest.CaptureFixture[str]) -> None:
    # a SHA-256 fingerprint in openssl's form; rich reads ":AB:" as the emoji code for 🆎
    fingerprint = "0B:88:22:B1:DE:3A:4A:AB:58:21"

    console.print(f"fingerprint: {fingerprint}", soft_wrap=True)

    assert capsys.readouterr().out.strip() == f"fingerprint: {fingerprint}"
