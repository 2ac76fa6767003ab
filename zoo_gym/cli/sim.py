"""`gym-sim`: local federations and attack simulations."""

from __future__ import annotations

import logging
import sys
import tempfile
from collections.abc import Callable
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
    rounds: Annotated[
        int | None,
        typer.Option(
            help="rounds to run in all (default 3; with --method grpo or gspo, the warm-up + 5)",
            min=1,
        ),
    ] = None,
    aggregator: Annotated[
        str | None,
        typer.Option(help="aggregation rule (default: fedavg, or trimmed_mean with --byzantine)"),
    ] = None,
    steps: Annotated[int, typer.Option(help="local training steps per round", min=1)] = 30,
    codec: Annotated[str, typer.Option(help="update codec")] = "bitdelta",
    byzantine: Annotated[
        str | None,
        typer.Option(
            help="add contributors that attack: sign_flip, scaling, ipm, gaussian, label_flip, random_completion"
        ),
    ] = None,
    byzantine_clients: Annotated[
        int, typer.Option(help="how many attack (with --byzantine)", min=1)
    ] = 1,
    workdir: Annotated[
        Path | None, typer.Option(help="keep everything here (default: a temp dir)")
    ] = None,
    timeout: Annotated[float, typer.Option(help="give up after this many seconds")] = 1800.0,
    method: Annotated[
        str, typer.Option(help="objective: sft, grpo or gspo (reward on the synthetic task)")
    ] = "sft",
    warmup_rounds: Annotated[
        int,
        typer.Option(
            help="grpo / gspo: SFT rounds first, then the operator switches the policy to --method (0: none)",
            min=0,
        ),
    ] = 3,
) -> None:
    """Run a coordinator and CLIENTS contributors on 127.0.0.1 for ROUNDS rounds.

    With --method grpo or gspo the federation first runs --warmup-rounds SFT rounds (the tiny base
    never gets a sum exactly right, so GRPO would start without a signal), then stages
    training.method through the REST API as an operator would; the table shows each round's
    validation loss, mean reward (closeness + exact_answer) and exact-answer accuracy.
    """
    from zoo_gym.client.byzantine import BYZANTINE_ATTACKS
    from zoo_gym.core.protocol import OBJECTIVES
    from zoo_gym.simulation.demo import GRPO_REWARDS, Federation

    if byzantine is not None and byzantine not in BYZANTINE_ATTACKS:
        raise typer.BadParameter(
            f"--byzantine must be one of {', '.join(BYZANTINE_ATTACKS)}, not {byzantine!r}"
        )
    if method not in OBJECTIVES:
        raise typer.BadParameter(f"--method must be one of {', '.join(OBJECTIVES)}, not {method!r}")
    rl = method != "sft"
    warmup = warmup_rounds if rl else 0
    total = rounds if rounds is not None else (warmup + 5 if rl else 3)
    if rl and total <= warmup:
        raise typer.BadParameter(
            f"--rounds ({total}) must exceed --warmup-rounds ({warmup}) to run any {method} round"
        )
    rule = aggregator or ("trimmed_mean" if byzantine else "fedavg")
    work = workdir or Path(tempfile.mkdtemp(prefix="zoo-gym-demo-"))
    attackers = f" + {byzantine_clients} running {byzantine}" if byzantine else ""
    plan = f"{warmup} sft rounds, then {method}" if warmup else method

    def objective(row: dict[str, Any]) -> str:  # the coordinator scores by reward only in RL rounds
        return "sft" if row.get("reward_before") is None else method

    def show(row: dict[str, Any]) -> None:
        reward = (
            f"mean reward {row['reward_before']:.4f} -> {row.get('mean_reward') or 0.0:.4f}, "
            if row.get("reward_before") is not None
            else ""
        )
        console.print(
            f"round {row['round']} ({objective(row)}): {row['accepted']}/{row['participants']} accepted, "
            f"validation loss {row['loss_before']:.4f} -> {row['loss_after']:.4f}, {reward}"
            f"{row['published_version'] or row['status']}"
        )

    with Federation(
        work,
        clients=clients,
        rounds=total,
        aggregator=rule,
        steps=steps,
        codec=codec,
        byzantine=byzantine or "",
        byzantine_clients=byzantine_clients,
        stay=True,
        method=method,
        warmup_rounds=warmup,
    ) as fed:
        console.print(f"preparing tiny model and {fed.total_clients} data shards in {work} ...")
        fed.prepare()
        fed.start()
        console.print(
            f"coordinator on 127.0.0.1:{fed.port} (REST :{fed.rest_port}); "
            f"{clients} clients{attackers} joining; {plan}"
        )
        fed.wait(timeout_s=timeout, on_round=show)
        fed.wait_clients(60)
        rows = fed.summaries()
        scores = {}
        if rl:  # each round's resulting model, scored on the validation set
            console.print("scoring each round's model on the validation set (greedy) ...")
            scores = fed.task_scores([r["published_version"] or r["base_version"] for r in rows])
        console.print(
            _demo_table(
                rows,
                scores,
                title=f"zoo-gym demo: {clients} clients{attackers}, {plan}, {rule}, {codec}",
                objective=objective,
            )
        )
        # each contributor's own statement, checked against the ledger
        for i in range(fed.total_clients):
            console.print(f"\n[bold]{fed.client_name(i)}[/bold]: gym-client rewards --verify")
            report = fed.reward_report(i, "--verify", width=max(console.width, 120))
            sys.stdout.write(report.stdout or report.stderr)
            sys.stdout.flush()
    rl_rows = [r for r in rows if r.get("reward_before") is not None]
    if rl_rows:  # the reward of the base the RL rounds started from and of the base they end on
        end = (
            rl_rows[-1]["mean_reward"]
            if rl_rows[-1]["status"] == "published"
            else rl_rows[-1]["reward_before"]
        )
        console.print(
            f"{method} rounds {rl_rows[0]['round']}-{rl_rows[-1]['round']}: mean validation reward "
            f"({' + '.join(GRPO_REWARDS)}) {rl_rows[0]['reward_before']:.4f} -> {end or 0.0:.4f}"
        )
    if rows:
        console.print(
            f"validation loss {rows[0]['loss_before']:.4f} -> {rows[-1]['loss_after']:.4f} "
            f"over {len(rows)} rounds; logs and ledger in {work}"
        )


def _demo_table(
    rows: list[dict[str, Any]],
    scores: dict[str, tuple[float, float]],
    *,
    title: str,
    objective: Callable[[dict[str, Any]], str],
) -> Table:
    """One row per round; with `scores` (closeness, exact-answer accuracy per model version) the
    task columns of the model each round ends on."""
    table = Table(title=title)
    columns = (
        "round",
        "objective",
        "base",
        "accepted",
        "val loss before",
        "val loss after",
        *(("reward before", "reward after", "closeness", "exact acc") if scores else ()),
        "result",
        "seconds",
    )
    for col in columns:
        table.add_column(col, justify="right")
    for row in rows:
        rl = row.get("reward_before") is not None
        task = scores.get(row["published_version"] or row["base_version"], (0.0, 0.0))
        table.add_row(
            str(row["round"]),
            objective(row),
            row["base_version"],
            f"{row['accepted']}/{row['participants']}",
            f"{row['loss_before']:.4f}",
            f"{row['loss_after']:.4f}",
            *(
                (
                    f"{row['reward_before']:.4f}" if rl else "",
                    f"{row.get('mean_reward') or 0.0:.4f}" if rl else "",
                    f"{task[0]:.4f}",
                    f"{task[1]:.3f}",
                )
                if scores
                else ()
            ),
            row["published_version"] or row["status"],
            f"{row['seconds']:.1f}",
        )
    return table


@app.command()
@friendly
def run(
    config: Annotated[
        Path | None,
        typer.Option("--config", "-c", help="sweep TOML (keys as the flags, snake_case)"),
    ] = None,
    aggregators: Annotated[str | None, typer.Option(help="comma-separated rules")] = None,
    attacks: Annotated[str | None, typer.Option(help="comma-separated attacks")] = None,
    shares: Annotated[
        str | None, typer.Option(help="comma-separated Byzantine shares, e.g. 0.1,0.2,0.3")
    ] = None,
    clients: Annotated[int | None, typer.Option(help="virtual clients per federation")] = None,
    rounds: Annotated[int | None, typer.Option(help="rounds per federation")] = None,
    steps: Annotated[int | None, typer.Option(help="local training steps per round")] = None,
    f: Annotated[
        int | None, typer.Option("--f", help="Byzantine updates the rules tolerate")
    ] = None,
    engine: Annotated[str | None, typer.Option(help="inprocess or ray")] = None,
    jobs: Annotated[int | None, typer.Option(help="cells in parallel (inprocess engine)")] = None,
    seed: Annotated[int | None, typer.Option(help="seed for data, attackers and training")] = None,
    out: Annotated[
        Path, typer.Option(help="directory for results.csv, results.md and the plots")
    ] = Path("sim-results"),
) -> None:
    """Run an attack matrix (aggregators x attacks x Byzantine shares) and write tables and plots."""
    setup_logging(False)
    from rich.markdown import Markdown
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from zoo_gym.simulation.experiment import CellResult, SweepError, load_sweep, run_sweep
    from zoo_gym.simulation.report import write_report

    # after flwr's import: one warning per federation otherwise
    logging.getLogger("flwr").setLevel(logging.ERROR)

    def items(value: str) -> list[str]:
        return [v.strip() for v in value.split(",") if v.strip()]

    def numbers(value: str) -> list[float]:
        try:
            return [float(v) for v in items(value)]
        except ValueError:
            raise SweepError(f"--shares takes numbers like 0.1,0.2,0.3, not {value!r}") from None

    flags: dict[str, Any] = {
        "aggregators": aggregators and items(aggregators),
        "attacks": attacks and items(attacks),
        "byzantine_shares": shares and numbers(shares),
        "clients": clients,
        "rounds": rounds,
        "steps": steps,
        "f": f,
        "engine": engine,
        "jobs": jobs,
        "seed": seed,
    }
    sweep = load_sweep(config, {k: v for k, v in flags.items() if v is not None})
    cells = list(sweep.cells())
    console.print(
        f"{len(cells)} federations: {len(sweep.aggregators)} aggregators x ({len(sweep.attacks)} attacks "
        f"x {len(sweep.byzantine_shares)} shares + no attack), {sweep.clients} clients, "
        f"{sweep.rounds} rounds, f = {sweep.tolerated}, engine {sweep.engine}"
    )
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("running", total=len(cells))

        def show(r: CellResult) -> None:
            progress.advance(task)
            progress.console.print(
                f"{r.aggregator:>16} {r.attack:>17} {round(100 * r.byzantine_share):>3}%: "
                f"loss {r.losses[0]:.3f} -> {r.losses[-1]:.3f} ({r.seconds:.0f} s)"
            )

        results = run_sweep(sweep, out / "work", on_result=show)
    paths = write_report(results, sweep, out)
    console.print(Markdown((out / "results.md").read_text()))
    console.print("wrote " + ", ".join(str(p) for p in paths))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
