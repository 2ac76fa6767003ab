"""`gym-coordinator admin models`: published base versions, their signed manifests and files
(`/models`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from zoo_gym.cli.admin.common import AdminError, Format, FormatOpt, command, emit, get_api, table
from zoo_gym.cli.common import console

MODEL_COLUMNS = [
    "version",
    "parent",
    "round",
    "aggregator",
    "contributors",
    "files",
    "size_bytes",
    "published_at",
]

app = typer.Typer(help="Published base models.", no_args_is_help=True)


@app.command("list")
@command
def models_list(ctx: typer.Context, format: FormatOpt = Format.table) -> None:
    """Published base versions."""
    data = get_api(ctx).call("GET", "/models")
    emit(data, format, table(data, MODEL_COLUMNS, title="models"))


@app.command("show")
@command
def models_show(ctx: typer.Context, version: str, format: FormatOpt = Format.table) -> None:
    """The signed manifest of a version."""
    data = get_api(ctx).call("GET", f"/models/{version}/manifest")
    files = [{"file": n, **f} for n, f in sorted(data["manifest"]["files"].items())]
    emit(data, format, table(files, ["file", "size", "sha256"], title=f"{version} files"))


@app.command("download")
@command
def models_download(
    ctx: typer.Context,
    version: str,
    out: Annotated[Path, typer.Option(help="directory to write VERSION/ into")] = Path("."),
) -> None:
    """Download every file of a version, checking each SHA-256 against the manifest."""
    api = get_api(ctx)
    manifest = api.call("GET", f"/models/{version}/manifest")["manifest"]
    target = out / version
    target.mkdir(parents=True, exist_ok=True)
    for name, entry in sorted(manifest["files"].items()):
        if Path(name).name != name:
            raise AdminError(f"the manifest names a file outside the version directory: {name!r}")
        api.download(f"/models/{version}/files/{name}", target / name, sha256=entry["sha256"])
    console.print(f"{version}: {len(manifest['files'])} files in {target}, SHA-256 checked")
