"""`gym-coordinator admin ledger`: the Merkle log's entries, its latest checkpoint, and inclusion
and consistency proofs (`/ledger`), each proof verified here against the roots it names."""

from __future__ import annotations

from typing import Annotated

import typer

from zoo_gym.cli.admin.common import (
    AdminError,
    Format,
    FormatOpt,
    command,
    emit,
    fields,
    get_api,
    table,
)
from zoo_gym.core import merkle

app = typer.Typer(help="The Merkle log: entries, checkpoints, proofs.", no_args_is_help=True)


@app.command("entries")
@command
def ledger_entries(
    ctx: typer.Context,
    start: Annotated[int, typer.Option(help="first index")] = 0,
    limit: Annotated[int, typer.Option(help="at most this many")] = 100,
    format: FormatOpt = Format.table,
) -> None:
    """Log entries (canonical JSON records)."""
    data = get_api(ctx).call("GET", "/ledger/entries", params={"start": start, "limit": limit})
    rows = [{**e, "record": e["record"][:100]} for e in data["entries"]]
    title = f"log entries {start}.. of {data['size']}"
    emit(data, format, table(rows, ["index", "kind", "leaf_hash", "record"], title=title))


@app.command("checkpoint")
@command
def ledger_checkpoint(
    ctx: typer.Context,
    create: Annotated[
        bool, typer.Option("--create", help="sign a new checkpoint now (admin)")
    ] = False,
    format: FormatOpt = Format.table,
) -> None:
    """The latest signed checkpoint (tree size and root)."""
    data = get_api(ctx).call("POST" if create else "GET", "/ledger/checkpoint")
    emit(data, format, fields(data, title="checkpoint"))


@app.command("proof")
@command
def ledger_proof(
    ctx: typer.Context,
    index: Annotated[int, typer.Argument(help="log entry index")],
    tree_size: Annotated[
        int | None, typer.Option(help="default: the latest checkpoint's size")
    ] = None,
    format: FormatOpt = Format.table,
) -> None:
    """Inclusion proof of an entry, verified here against the root it names."""
    data = get_api(ctx).call(
        "GET", "/ledger/proofs/inclusion", params={"index": index, "tree_size": tree_size}
    )
    data["verified"] = merkle.verify_inclusion(
        data["index"],
        data["tree_size"],
        bytes.fromhex(data["leaf_hash"]),
        [bytes.fromhex(p) for p in data["path"]],
        bytes.fromhex(data["root"]),
    )
    emit(data, format, fields(data, title=f"inclusion of entry {index}"))
    if not data["verified"]:
        raise AdminError("the inclusion proof does NOT verify against its root")


@app.command("consistency")
@command
def ledger_consistency(
    ctx: typer.Context,
    old_size: int,
    new_size: Annotated[
        int | None, typer.Argument(help="default: the latest checkpoint's size")
    ] = None,
    format: FormatOpt = Format.table,
) -> None:
    """Consistency proof between two tree sizes, verified here."""
    params = {"old_size": old_size, "new_size": new_size}
    data = get_api(ctx).call("GET", "/ledger/proofs/consistency", params=params)
    data["verified"] = merkle.verify_consistency(
        data["old_size"],
        data["new_size"],
        bytes.fromhex(data["old_root"]),
        bytes.fromhex(data["new_root"]),
        [bytes.fromhex(p) for p in data["path"]],
    )
    emit(data, format, fields(data, title=f"consistency {old_size} -> {data['new_size']}"))
    if not data["verified"]:
        raise AdminError("the consistency proof does NOT verify")
