"""`gym-sim`: local federations and attack simulations."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from zoo_gym.cli.common import console, friendly

app = typer.Typer(help="Simulate zoo-gym federations.", no_args_is_help=True, add_completion=False)


@app.callback()
def sim() -> None:
    """Simulate zoo-gym federations: `demo` runs a whole one on this machine."""


@app.command()
@friendly
def demo(
    clients: Annotated[int, typer.Option(help="honest contributors", min=1)] = 3,
    rounds: Annotated[int, typer.Option(help="rounds to run", min=1)] = 3,
    aggregator: Annotated[str, typer.Option(help="aggregation rule")] = "fedavg",
    steps: Annotated[int, typer.Option(help="local training steps per round", min=1)] = 30,
    codec: Annotated[str, typer.Option(help="update codec")] = "bitdelta",
    workdir: Annotated[Path | None, typer.Option(help="keep everything here (default: a temp dir)")] = None,
    timeout: Annotated[float, typer.Option(help="give up after this many seconds")] = 1800.0,
) -> None:
    """Run a coordinator and CLIENTS contributors on 127.0.0.1 for ROUNDS rounds."""
    from zoo_gym.simulation.demo import Federation

    work = workdir or Path(tempfile.mkdtemp(prefix="zoo-gym-demo-"))
    table = Table(title=f"zoo-gym demo: {clients} clients, {aggregator}, {codec}")
    for col in ("round", "base", "participants", "accepted", "rejected", "val loss before", "val loss after", "result", "seconds"):
        table.add_column(col, justify="right")

    def show(row: dict[str, Any]) -> None:
        cells = (str(row["round"]), row["base_version"], str(row["participants"]), str(row["accepted"]),
                 str(row["rejected"]), f"{row['loss_before']:.4f}", f"{row['loss_after']:.4f}",
                 row["published_version"] or row["status"], f"{row['seconds']:.1f}")
        table.add_row(*cells)
        console.print(f"round {row['round']}: {row['accepted']}/{row['participants']} accepted, "
                      f"validation loss {row['loss_before']:.4f} -> {row['loss_after']:.4f}, "
                      f"{row['published_version'] or row['status']}")

    with Federation(work, clients=clients, rounds=rounds, aggregator=aggregator, steps=steps, codec=codec) as fed:
        console.print(f"preparing tiny model and {clients} data shards in {work} ...")
        fed.prepare()
        fed.start()
        console.print(f"coordinator on 127.0.0.1:{fed.port} (REST :{fed.rest_port}); {clients} clients joining")
        fed.wait(timeout_s=timeout, on_round=show)
        fed.wait_clients(30)
    console.print(table)
    rows = fed.summaries()
    if rows:
        console.print(f"validation loss {rows[0]['loss_before']:.4f} -> {rows[-1]['loss_after']:.4f} "
                      f"over {len(rows)} rounds; logs and ledger in {work}")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
