"""`gym-coordinator admin rounds`: round history (`/rounds`) and the round loop's controls
(`/rounds/control`, pause, resume, start, abort)."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from zoo_gym.cli.admin.common import (
    Format,
    FormatOpt,
    ReasonOpt,
    command,
    emit,
    fields,
    get_api,
    table,
)

ROUND_COLUMNS = ["number", "status", "base_version", "new_version", "aggregator", "closed_at"]
SUBMISSION_COLUMNS = [
    "id",
    "contributor_id",
    "decision",
    "reason",
    "selected",
    "weight",
    "score",
    "reward",
]

app = typer.Typer(help="Rounds: history and control.", no_args_is_help=True)


def _control(data: dict[str, Any], fmt: Format) -> None:
    summary = {
        "paused": data["paused"],
        "paused by": (data["pause"] or {}).get("by"),
        "start requested": data["start"] is not None,
        "abort requested": ", ".join(str(n) for n in data["aborts"]) or None,
        "current round": data["current_round"],
        "policy change pending": data["policy_pending"],
    }
    emit(data, fmt, fields(summary, title="round control"))


@app.command("list")
@command
def rounds_list(ctx: typer.Context, format: FormatOpt = Format.table) -> None:
    """Every round, oldest first."""
    data = get_api(ctx).call("GET", "/rounds")
    emit(data, format, table(data, ROUND_COLUMNS, title="rounds"))


@app.command("show")
@command
def rounds_show(ctx: typer.Context, number: int, format: FormatOpt = Format.table) -> None:
    """One round with its submissions and the decisions about them."""
    data = get_api(ctx).call("GET", f"/rounds/{number}")
    emit(
        data,
        format,
        fields(data, title=f"round {number}", skip=("submissions", "rewards")),
        table(
            data["submissions"], SUBMISSION_COLUMNS, title="submissions", short=["contributor_id"]
        ),
    )


@app.command("summary")
@command
def rounds_summary(ctx: typer.Context, number: int, format: FormatOpt = Format.table) -> None:
    """Counts of one round: received, accepted, rejected by reason, rewards."""
    data = get_api(ctx).call("GET", f"/rounds/{number}/summary")
    emit(data, format, fields(data, title=f"round {number}"))


@app.command("status")
@command
def rounds_status(ctx: typer.Context, format: FormatOpt = Format.table) -> None:
    """Pause, start and abort requests the round loop has not acted on yet."""
    _control(get_api(ctx).call("GET", "/rounds/control"), format)


@app.command("pause")
@command
def rounds_pause(
    ctx: typer.Context, reason: ReasonOpt = "", format: FormatOpt = Format.table
) -> None:
    """Start no new round until resumed (a round under way finishes)."""
    _control(get_api(ctx).call("POST", "/rounds/pause", body={"reason": reason}), format)


@app.command("resume")
@command
def rounds_resume(
    ctx: typer.Context, reason: ReasonOpt = "", format: FormatOpt = Format.table
) -> None:
    """Lift a pause."""
    _control(get_api(ctx).call("POST", "/rounds/resume", body={"reason": reason}), format)


@app.command("start")
@command
def rounds_start(
    ctx: typer.Context, reason: ReasonOpt = "", format: FormatOpt = Format.table
) -> None:
    """Run the next round now, even while paused."""
    _control(get_api(ctx).call("POST", "/rounds/start", body={"reason": reason}), format)


@app.command("abort")
@command
def rounds_abort(
    ctx: typer.Context,
    number: int,
    reason: Annotated[str, typer.Option("--reason", "-r", help="why")],
    format: FormatOpt = Format.table,
) -> None:
    """Abort an open round: nothing is aggregated or published."""
    _control(get_api(ctx).call("POST", f"/rounds/{number}/abort", body={"reason": reason}), format)
