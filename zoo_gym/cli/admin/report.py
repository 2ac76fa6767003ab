"""`gym-coordinator admin report`: one contributor's report, per round the decision, why, score
and reward, with totals (`/contributors/{id}/report`)."""

from __future__ import annotations

from typing import Annotated

import typer

from zoo_gym.cli.admin.common import Format, FormatOpt, command, emit, fields, get_api, table

REPORT_COLUMNS = [
    "round",
    "round_status",
    "decision",
    "reason",
    "selected",
    "score",
    "quality",
    "reward",
]


@command
def report(
    ctx: typer.Context,
    contributor_id: str,
    round_number: Annotated[int | None, typer.Option("--round", help="only this round")] = None,
    format: FormatOpt = Format.table,
) -> None:
    """A contributor's report: per round the decision, why, score and reward; totals."""
    data = get_api(ctx).call(
        "GET", f"/contributors/{contributor_id}/report", params={"round": round_number}
    )
    title = f"{data['name']} ({contributor_id[:12]}, {data['status']})"
    emit(
        data,
        format,
        table(data["rounds"], REPORT_COLUMNS, title=title),
        fields(data["totals"], title="totals"),
    )
