"""`gym-coordinator admin openapi`: the REST API's OpenAPI description (`/openapi.json`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from zoo_gym.cli.admin.common import AdminError, command, get_api
from zoo_gym.cli.common import err_console


@command
def openapi(
    ctx: typer.Context,
    output: Annotated[
        Path | None,
        typer.Option("--output", "-o", help="write the description to FILE instead of stdout"),
    ] = None,
) -> None:
    """The API's OpenAPI description (JSON); a viewer key is enough."""
    text = json.dumps(get_api(ctx).call("GET", "/openapi.json"), indent=2, sort_keys=True) + "\n"
    if output is None:
        typer.echo(text, nl=False)
        return
    try:
        output.write_text(text)
    except OSError as exc:
        raise AdminError(f"cannot write {output}: {exc.strerror}") from None
    err_console.print(f"wrote {output}", markup=False)
