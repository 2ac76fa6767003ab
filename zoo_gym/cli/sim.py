"""`gym-sim`: local federations and attack simulations."""

from __future__ import annotations

import logging
import sys
import tempfile
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from zoo_gym.cli.common import console, friendly, setup_logging

app = typer.Typer(help="Simulate zoo-gym federations.", no_args_is_help=True, add_completion=False)


@app.callback()
def sim() -> None:
    """Simulate zoo-gym federations: `demo` runs a whole one on this machine, `run` an attack matrix."""


@app.command()
@friendly
def demo(
    clients: Annotated[int, typer.Option(help="honest contributors", min=1)] = 3,
    rounds: Annotated[int, typer.Option(help="rounds to run", min=1)] = 3,
    aggregator: Annotated[str | None, typer.Option(
        help="aggregation rule (default: fedavg, or trimmed_mean with --byzantine)")] = None,
    steps: Annotated[int, typer.Option(help="local training steps per round", min=1)] = 30,
    codec: Annotated[str, typer.Option(help="update codec")] = "bitdelta",
    byzantine: Annotated[str | None, typer.Option(
        help="add contributors that attack: sign_flip, scaling, ipm, gaussian, label_flip, random_completion")] = None,
    byzantine_clients: Annotated[int, typer.Option(help="how many attack (with --byzantine)", min=1)] = 1,
    workdir: Annotated[Path | None, typer.Option(help="keep everything here (default: a temp dir)")] = None,
    timeout: Annotated[float, typer.Option(help="give up after this many seconds")] = 1800.0,
) -> None:
    """Run a coordinator and CLIENTS contributors on 127.0.0.1 for ROUNDS rounds."""
    from zoo_gym.client.byzantine import BYZANTINE_ATTACKS
    from zoo_gym.simulation.demo import Federation

    if byzantine is not None and byzantine not in BYZANTINE_ATTACKS:
        raise typer.BadParameter(f"--byzantine must be one of {', '.join(BYZANTINE_ATTACKS)}, not {byzantine!r}")
    rule = aggregator or ("trimmed_mean" if byzantine else "fedavg")
    work = workdir or Path(tempfile.mkdtemp(prefix="zoo-gym-demo-"))
    attackers = f" + {byzantine_clients} running {byzantine}" if byzantine else ""
    table = Table(title=f"zoo-gym demo: {clients} clients{attackers}, {rule}, {codec}")
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

    with Federation(work, clients=clients, rounds=rounds, aggregator=rule, steps=steps, codec=codec,
                    byzantine=byzantine or "", byzantine_clients=byzantine_clients, stay=True) as fed:
        console.print(f"preparing tiny model and {fed.total_clients} data shards in {work} ...")
        fed.prepare()
        fed.start()
        console.print(f"coordinator on 127.0.0.1:{fed.port} (REST :{fed.rest_port}); "
                      f"{clients} clients{attackers} joining")
        fed.wait(timeout_s=timeout, on_round=show)
        fed.wait_clients(60)
        console.print(table)
        for i in range(fed.total_clients):  # each contributor's own statement, checked against the ledger
            console.print(f"\n[bold]{fed.client_name(i)}[/bold]: gym-client rewards --verify")
            report = fed.reward_report(i, "--verify", width=max(console.width, 120))
            sys.stdout.write(report.stdout or report.stderr)
            sys.stdout.flush()
    rows = fed.summaries()
    if rows:
        console.print(f"validation loss {rows[0]['loss_before']:.4f} -> {rows[-1]['loss_after']:.4f} "
                      f"over {len(rows)} rounds; logs and ledger in {work}")


@app.command()
@friendly
def run(
    config: Annotated[Path | None, typer.Option("--config", "-c", help="sweep TOML (keys as the flags, snake_case)")] = None,
    aggregators: Annotated[str | None, typer.Option(help="comma-separated rules")] = None,
    attacks: Annotated[str | None, typer.Option(help="comma-separated attacks")] = None,
    shares: Annotated[str | None, typer.Option(help="comma-separated Byzantine shares, e.g. 0.1,0.2,0.3")] = None,
    clients: Annotated[int | None, typer.Option(help="virtual clients per federation")] = None,
    rounds: Annotated[int | None, typer.Option(help="rounds per federation")] = None,
    steps: Annotated[int | None, typer.Option(help="local training steps per round")] = None,
    f: Annotated[int | None, typer.Option("--f", help="Byzantine updates the rules tolerate")] = None,
    engine: Annotated[str | None, typer.Option(help="inprocess or ray")] = None,
    jobs: Annotated[int | None, typer.Option(help="cells in parallel (inprocess engine)")] = None,
    seed: Annotated[int | None, typer.Option(help="seed for data, attackers and training")] = None,
    out: Annotated[Path, typer.Option(help="directory for results.csv, results.md and the plots")] = Path("sim-results"),
) -> None:
    """Run an attack matrix (aggregators x attacks x Byzantine shares) and write tables and plots."""
    setup_logging(False)
    from rich.markdown import Markdown
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from zoo_gym.simulation.experiment import CellResult, SweepError, load_sweep, run_sweep
    from zoo_gym.simulation.report import write_report

    logging.getLogger("flwr").setLevel(logging.ERROR)  # after flwr's import: one warning per federation otherwise

    def items(value: str) -> list[str]:
        return [v.strip() for v in value.split(",") if v.strip()]

    def numbers(value: str) -> list[float]:
        try:
            return [float(v) for v in items(value)]
        except ValueError:
            raise SweepError(f"--shares takes numbers like 0.1,0.2,0.3, not {value!r}") from None

    flags: dict[str, Any] = {
        "aggregators": aggregators and items(aggregators), "attacks": attacks and items(attacks),
        "byzantine_shares": shares and numbers(shares), "clients": clients, "rounds": rounds,
        "steps": steps, "f": f, "engine": engine, "jobs": jobs, "seed": seed,
    }
    sweep = load_sweep(config, {k: v for k, v in flags.items() if v is not None})
    cells = list(sweep.cells())
    console.print(f"{len(cells)} federations: {len(sweep.aggregators)} aggregators x ({len(sweep.attacks)} attacks "
                  f"x {len(sweep.byzantine_shares)} shares + no attack), {sweep.clients} clients, "
                  f"{sweep.rounds} rounds, f = {sweep.tolerated}, engine {sweep.engine}")
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("running", total=len(cells))

        def show(r: CellResult) -> None:
            progress.advance(task)
            progress.console.print(f"{r.aggregator:>16} {r.attack:>17} {round(100 * r.byzantine_share):>3}%: "
                                   f"loss {r.losses[0]:.3f} -> {r.losses[-1]:.3f} ({r.seconds:.0f} s)")

        results = run_sweep(sweep, out / "work", on_result=show)
    paths = write_report(results, sweep, out)
    console.print(Markdown((out / "results.md").read_text()))
    console.print("wrote " + ", ".join(str(p) for p in paths))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
