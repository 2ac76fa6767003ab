"""`gym-client`: contribute to a zoo-gym network."""

from __future__ import annotations

import json
import sys
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from zoo_gym.cli.common import console, friendly, setup_logging

app = typer.Typer(help="Contribute to a zoo-gym network.", no_args_is_help=True, add_completion=False)

CONFIG = "client.toml"


@app.command()
@friendly
def init(
    home: Annotated[Path, typer.Option(help="directory for your key, config and local state")] = Path("contributor"),
    name: Annotated[str, typer.Option(help="name shown to the operator")] = "contributor",
) -> None:
    """Create an Ed25519 identity and a config file."""
    from zoo_gym.core.identity import Identity

    home.mkdir(parents=True, exist_ok=True)
    if (home / "client.key").exists():
        raise FileExistsError(f"{home / 'client.key'} exists; your identity is already set up")
    identity = Identity.generate()
    identity.save(home / "client.key")
    (home / CONFIG).write_text(f'name = "{name}"\nkey = "client.key"\n')
    console.print(f"contributor {identity.contributor_id} ready in {home}")


@app.command()
@friendly
def join(
    coordinator: Annotated[str, typer.Argument(help="HOST:PORT of the coordinator")],
    data: Annotated[Path | None, typer.Option(help="your training data (Alpaca/ShareGPT JSONL)")] = None,
    home: Annotated[Path, typer.Option(help="directory made by `gym-client init`")] = Path("contributor"),
    method: Annotated[str, typer.Option(help="training method")] = "sft",
    ca_cert: Annotated[Path | None, typer.Option(help="CA certificate for a TLS coordinator")] = None,
    max_rounds: Annotated[int | None, typer.Option(help="leave after this many submissions")] = None,
    device: Annotated[str | None, typer.Option(help="cpu, cuda, cuda:1 ...")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
    byzantine: Annotated[str | None, typer.Option(
        hidden=True, help="attack the federation on purpose: label_flip, random_completion, sign_flip, scaling, ipm, gaussian",
    )] = None,
) -> None:
    """Register, then train and submit an update every round until stopped (Ctrl-C)."""
    setup_logging(verbose)
    from zoo_gym.cli.progress import JoinDisplay
    from zoo_gym.client.config import ClientConfig, load_client_config
    from zoo_gym.client.session import JoinError
    from zoo_gym.client.session import join as run_join

    if method != "sft":
        raise JoinError(f"method {method!r} is not available; use --method sft")
    cfg = load_client_config(home / CONFIG)
    overrides = {"coordinator": coordinator, "data": data and data.resolve(), "ca_cert": ca_cert,
                 "max_rounds": max_rounds, "device": device, "byzantine": byzantine}
    cfg = ClientConfig.model_validate({**cfg.model_dump(), **{k: v for k, v in overrides.items() if v is not None}})
    with JoinDisplay(console) as display:
        made = run_join(cfg, on_event=display.event, say=display.say)
    console.print(f"left after {made} submission(s)")


@app.command()
@friendly
def status(
    home: Annotated[Path, typer.Option(help="directory made by `gym-client init`")] = Path("contributor"),
    format: Annotated[str, typer.Option("--format", help="table or json")] = "table",
) -> None:
    """Show local state: identity, coordinator and contributions."""
    from dataclasses import asdict

    from rich.table import Table

    from zoo_gym.client.state import LocalState

    state = LocalState.load(home / "state" / "state.json")
    rows = [asdict(c) for c in sorted(state.contributions.values(), key=lambda c: c.round)]
    if format == "json":
        console.print_json(json.dumps({"contributor_id": state.contributor_id,
                                       "coordinator": state.coordinator, "contributions": rows}))
        return
    table = Table(title=f"contributor {state.contributor_id[:16] or '(not joined yet)'} @ {state.coordinator or '-'}")
    for col in ("round", "base", "decision", "reason", "upload bytes", "train loss"):
        table.add_column(col)
    for r in rows:
        table.add_row(str(r["round"]), r["base_version"], r["decision"], r["reason"], str(r["payload_bytes"]),
                      f"{r['train_loss']:.4f}")
    console.print(table)


class RewardsFormat(StrEnum):
    table = "table"
    json = "json"
    csv = "csv"
    html = "html"


@app.command()
@friendly
def rewards(
    home: Annotated[Path, typer.Option(help="directory made by `gym-client init`")] = Path("contributor"),
    api: Annotated[str | None, typer.Option(
        help="the coordinator's REST address, e.g. http://coordinator.example.org:8080 (default: api_url in client.toml)",
    )] = None,
    format: Annotated[RewardsFormat, typer.Option(
        "--format", help="table for people, json or csv for programs, html for a page with a plot",
    )] = RewardsFormat.table,
    out: Annotated[Path | None, typer.Option(help="write to this file (html: default rewards.html)")] = None,
    verify: Annotated[bool, typer.Option(
        "--verify", help="check every reward against the ledger's checkpoint signed by the coordinator key pinned at join",
    )] = False,
) -> None:
    """Your reward statement: per round the decision and why, quality, reward, reputation and privacy spent."""
    from rich.console import Console

    from zoo_gym.cli.common import err_console
    from zoo_gym.client import rewards as report
    from zoo_gym.client.config import load_client_config
    from zoo_gym.core.identity import Identity

    cfg = load_client_config(home / CONFIG)
    identity = Identity.load(cfg.path(cfg.key))
    pinned = report.pinned_coordinator_key(home / "state" / "state.json") if verify else b""
    url = report.api_base(api or cfg.api_url)
    with report.connect(url, ca_cert=cfg.ca_cert and cfg.path(cfg.ca_cert)) as http:
        session = report.ReportApi(http, identity)
        statement = report.fetch_statement(session)
        checked = report.verify_statement(session, statement, coordinator_key=pinned) if verify else None
    if format is RewardsFormat.html:
        target = out or Path("rewards.html")
        target.write_text(report.to_html(statement, checked, source=url), encoding="utf-8")
        console.print(f"wrote {target} ({len(statement.rounds)} round(s))", markup=False)
    elif format is RewardsFormat.table:
        if out is None:
            console.print(report.render_table(statement, checked))
        else:
            with out.open("w", encoding="utf-8") as fh:
                Console(file=fh, width=160).print(report.render_table(statement, checked))
    else:
        text = (report.to_json if format is RewardsFormat.json else report.to_csv)(statement, checked)
        if out is None:
            sys.stdout.write(text)
            sys.stdout.flush()
        else:
            out.write_text(text, encoding="utf-8")
    if checked is not None and not checked.ok:
        raise report.RewardsError(f"verification failed: {checked.problem}")
    if checked is not None:
        (console if format is RewardsFormat.table else err_console).print(checked.summary(), markup=False, soft_wrap=True)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
