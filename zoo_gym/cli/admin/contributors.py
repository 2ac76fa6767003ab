"""`gym-coordinator admin contributors`: contributors (`/contributors`) and the invitations that
admit them (`/contributors/invites`)."""

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

CONTRIBUTOR_COLUMNS = [
    "contributor_id",
    "name",
    "status",
    "status_reason",
    "reputation",
    "created_at",
]
INVITE_COLUMNS = ["prefix", "note", "uses", "max_uses", "expires_at", "revoked_at", "created_by"]

app = typer.Typer(help="Contributors: list, approve, ban, invite.", no_args_is_help=True)


def _contributor(data: dict[str, Any], fmt: Format) -> None:
    emit(data, fmt, fields(data, title=f"contributor {data['contributor_id']}"))


def _decide(ctx: typer.Context, contributor_id: str, action: str, reason: str, fmt: Format) -> None:
    """POST /contributors/{id}/{action} (approve, ban, unban) with its reason; show the result."""
    path = f"/contributors/{contributor_id}/{action}"
    _contributor(get_api(ctx).call("POST", path, body={"reason": reason}), fmt)


@app.command("list")
@command
def contributors_list(
    ctx: typer.Context,
    status: Annotated[str | None, typer.Option(help="active, pending or banned")] = None,
    format: FormatOpt = Format.table,
) -> None:
    """Registered contributors."""
    data = get_api(ctx).call("GET", "/contributors", params={"status": status})
    emit(data, format, table(data, CONTRIBUTOR_COLUMNS, title="contributors"))


@app.command("show")
@command
def contributors_show(
    ctx: typer.Context, contributor_id: str, format: FormatOpt = Format.table
) -> None:
    """One contributor."""
    _contributor(get_api(ctx).call("GET", f"/contributors/{contributor_id}"), format)


@app.command("approve")
@command
def contributors_approve(
    ctx: typer.Context,
    contributor_id: str,
    reason: ReasonOpt = "",
    format: FormatOpt = Format.table,
) -> None:
    """Let a pending contributor take part."""
    _decide(ctx, contributor_id, "approve", reason, format)


@app.command("ban")
@command
def contributors_ban(
    ctx: typer.Context,
    contributor_id: str,
    reason: Annotated[str, typer.Option("--reason", "-r", help="why (shown to the contributor)")],
    format: FormatOpt = Format.table,
) -> None:
    """Refuse a contributor's requests and submissions."""
    _decide(ctx, contributor_id, "ban", reason, format)


@app.command("unban")
@command
def contributors_unban(
    ctx: typer.Context,
    contributor_id: str,
    reason: ReasonOpt = "",
    format: FormatOpt = Format.table,
) -> None:
    """Lift a ban."""
    _decide(ctx, contributor_id, "unban", reason, format)


@app.command("invite")
@command
def contributors_invite(
    ctx: typer.Context,
    note: Annotated[str, typer.Option(help="whom the code is for (shown in the list)")] = "",
    uses: Annotated[int, typer.Option(min=1, help="new keys the code may admit")] = 1,
    valid_for_hours: Annotated[
        float, typer.Option(min=1 / 60, help="hours until the code expires")
    ] = 72.0,
    format: FormatOpt = Format.table,
) -> None:
    """Issue an invitation code (admission = "invite"); it is shown this once."""
    body = {"note": note, "uses": uses, "valid_for_hours": valid_for_hours}
    data = get_api(ctx).call("POST", "/contributors/invites", body=body)
    emit(data, format, fields(data, title="invitation: give the code to its contributor"))


@app.command("invites")
@command
def contributors_invites(
    ctx: typer.Context,
    usable: Annotated[bool, typer.Option(help="only codes that still admit")] = False,
    format: FormatOpt = Format.table,
) -> None:
    """Invitations issued (never their codes)."""
    data = get_api(ctx).call("GET", "/contributors/invites", params={"usable": usable or None})
    emit(data, format, table(data, INVITE_COLUMNS, title="invitations"))


@app.command("revoke-invite")
@command
def contributors_revoke_invite(
    ctx: typer.Context, prefix: str, format: FormatOpt = Format.table
) -> None:
    """Revoke an invitation by its prefix; its unused admissions lapse."""
    data = get_api(ctx).call("POST", f"/contributors/invites/{prefix}/revoke")
    emit(data, format, fields(data, title=f"invitation {prefix} revoked"))
