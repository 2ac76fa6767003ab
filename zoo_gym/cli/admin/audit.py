"""`gym-coordinator admin audit`: operator actions, who changed what and when (`/audit`)."""

from __future__ import annotations

from typing import Annotated

import typer

from zoo_gym.cli.admin.common import Format, FormatOpt, command, emit, get_api, table


@command
def audit(
    ctx: typer.Context,
    target: Annotated[str | None, typer.Option(help="only events about this target")] = None,
    format: FormatOpt = Format.table,
) -> None:
    """Operator actions: who changed what, and when."""
    data = get_api(ctx).call("GET", "/audit", params={"target": target})
    emit(
        data,
        format,
        table(data, ["id", "at", "actor", "action", "target", "detail"], title="audit"),
    )
