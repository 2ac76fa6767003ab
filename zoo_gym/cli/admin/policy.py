"""`gym-coordinator admin policy`: the policy rounds run with, and changes staged for the next
round (`/policy`)."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from zoo_gym.cli.admin.common import AdminError, Format, FormatOpt, command, emit, get_api, table

app = typer.Typer(help="Policy for the next round.", no_args_is_help=True)


def _flat(values: dict[str, Any], settable: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in settable:
        node: Any = values
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        out[key] = node
    return out


def _policy(data: dict[str, Any], fmt: Format) -> None:
    current = _flat(data["current"], data["settable"])
    pending = _flat(data["pending"], data["settable"]) if data["pending"] else {}
    rows = [
        {
            "setting": k,
            "current": v,
            "next round": pending.get(k, v) if k in data["pending_changes"] else "",
        }
        for k, v in current.items()
    ]
    title = f"policy (changes apply from round {data['next_round']})"
    emit(data, fmt, table(rows, ["setting", "current", "next round"], title=title))


def parse_setting(text: str) -> tuple[str, Any]:
    """`key=value`; the value is read as JSON when it parses (numbers, true, {...}), else text."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise AdminError(f"{text!r}: write settings as KEY=VALUE, e.g. aggregator=krum")
    try:
        value = json.loads(raw)
    except ValueError:
        value = raw
    return key.strip(), value


@app.command("show")
@command
def policy_show(ctx: typer.Context, format: FormatOpt = Format.table) -> None:
    """The policy rounds run with now, and a change staged for the next round."""
    _policy(get_api(ctx).call("GET", "/policy"), format)


@app.command("set")
@command
def policy_set(
    ctx: typer.Context,
    settings: Annotated[
        list[str], typer.Argument(help="KEY=VALUE ..., e.g. aggregator=krum training.clip_norm=1.0")
    ],
    format: FormatOpt = Format.table,
) -> None:
    """Change settings from the next round on (validated like coordinator.toml)."""
    patch = dict(parse_setting(s) for s in settings)
    _policy(get_api(ctx).call("PATCH", "/policy", body=patch), format)
