"""`gym-coordinator admin rewards`: rewards paid, per round and contributor (`/rewards`)."""

from __future__ import annotations

from typing import Annotated

import typer

from zoo_gym.cli.admin.common import Format, FormatOpt, command, emit, get_api, table

REWARD_COLUMNS = [
    "round_number",
    "contributor_id",
    "quality",
    "amount",
    "reputation_after",
    "recorded_at",
]


@command
def rewards(
    ctx: typer.Context,
    round_number: Annotated[int | None, typer.Option("--round", help="only this round")] = None,
    contributor: Annotated[str | None, typer.Option(help="only this contributor id")] = None,
    format: FormatOpt = Format.table,
) -> None:
    """Rewards paid, per round and contributor."""
    params = {"round": round_number, "contributor_id": contributor}
    data = get_api(ctx).call("GET", "/rewards", params=params)
    emit(data, format, table(data, REWARD_COLUMNS, title="rewards", short=["contributor_id"]))
