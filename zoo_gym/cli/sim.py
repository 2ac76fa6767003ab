"""`gym-sim`: local federations and attack simulations."""

from __future__ import annotations

import logging
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from zoo_gym.cli.common import console, friendly, setup_logging

if TYPE_CHECKING:
    from zoo_gym.simulation.sweep import CellResult, SweepConfig

app = typer.Typer(help="Simulate zoo-gym federations.", no_args_is_help=True, add_completion=False)


@app.callback()
def sim() -> None:
    """Simulate zoo-gym federations: `demo` runs a whole one on this machine, `run` an attack matrix."""


# `demo`'s options as Annotated aliases, so the command's signature stays readable
ClientsOption = Annotated[int, typer.Option(help="honest contributors", min=1)]
RoundsOption = Annotated[
    int | None,
    typer.Option(
        help="rounds to run in all (default 3; with --method grpo or gspo, the warm-up + 5)",
        min=1,
    ),
]
AggregatorOption = Annotated[
    str | None,
    typer.Option(help="aggregation rule (default: fedavg, or trimmed_mean with --byzantine)"),
]
StepsOption = Annotated[int, typer.Option(help="local training steps per round", min=1)]
CodecOption = Annotated[str, typer.Option(help="update codec")]
ByzantineOption = Annotated[
    str | None,
    typer.Option(
        help="add contributors that attack: sign_flip, scaling, ipm, gaussian, label_flip, random_completion"
    ),
]
ByzantineClientsOption = Annotated[
    int, typer.Option(help="how many attack (with --byzantine)", min=1)
]
WorkdirOption = Annotated[
    Path | None, typer.Option(help="keep everything here (default: a temp dir)")
]
TimeoutOption = Annotated[float, typer.Option(help="give up after this many seconds")]
MethodOption = Annotated[
    str, typer.Option(help="objective: sft, grpo or gspo (reward on the synthetic task)")
]
WarmupRoundsOption = Annotated[
    int,
    typer.Option(
        help="grpo / gspo: SFT rounds first, then the operator switches the policy to --method (0: none)",
        min=0,
    ),
]


@app.command()
@friendly
def demo(
    clients: ClientsOption = 3,
    rounds: RoundsOption = None,
    aggregator: AggregatorOption = None,
    steps: StepsOption = 30,
    codec: CodecOption = "bitdelta",
    byzantine: ByzantineOption = None,
    byzantine_clients: ByzantineClientsOption = 1,
    workdir: WorkdirOption = None,
    timeout: TimeoutOption = 1800.0,
    method: MethodOption = "sft",
    warmup_rounds: WarmupRoundsOption = 3,
) -> None:
    """Run a coordinator and CLIENTS contributors on 127.0.0.1 for ROUNDS rounds.

    With --method grpo or gspo the federation first runs --warmup-rounds SFT rounds (the tiny base
    never gets a sum exactly right, so GRPO would start without a signal), then stages
    training.method through the REST API as an operator would; the table shows each round's
    validation loss, mean reward (closeness + exact_answer) and exact-answer accuracy.
    """
    plan = demo_plan(
        clients=clients,
        rounds=rounds,
        aggregator=aggregator,
        steps=steps,
        codec=codec,
        byzantine=byzantine,
        byzantine_clients=byzantine_clients,
        workdir=workdir,
        timeout=timeout,
        method=method,
        warmup_rounds=warmup_rounds,
    )
    rows = _run_demo(plan)
    _print_summary(plan, rows)


@dataclass(frozen=True)
class DemoPlan:
    """What `gym-sim demo` runs: its options checked, with their defaults filled in."""

    clients: int
    rounds: int  # in all, warm-up included
    aggregator: str
    steps: int
    codec: str
    byzantine: str | None
    byzantine_clients: int
    workdir: Path
    timeout: float
    method: str
    warmup: int  # SFT rounds before the first `method` round

    @property
    def rl(self) -> bool:
        return self.method != "sft"

    @property
    def attackers(self) -> str:
        return f" + {self.byzantine_clients} running {self.byzantine}" if self.byzantine else ""

    @property
    def schedule(self) -> str:
        return f"{self.warmup} sft rounds, then {self.method}" if self.warmup else self.method

    def objective(self, row: dict[str, Any]) -> str:
        """The objective a round ran: the coordinator scores by reward only in RL rounds."""
        return "sft" if row.get("reward_before") is None else self.method


def demo_plan(
    *,
    clients: int,
    rounds: int | None,
    aggregator: str | None,
    steps: int,
    codec: str,
    byzantine: str | None,
    byzantine_clients: int,
    workdir: Path | None,
    timeout: float,
    method: str,
    warmup_rounds: int,
) -> DemoPlan:
    """Check `demo`'s options against each other and fill in their defaults."""
    from zoo_gym.client.byzantine import BYZANTINE_ATTACKS
    from zoo_gym.core.protocol import OBJECTIVES

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
    return DemoPlan(
        clients=clients,
        rounds=total,
        aggregator=aggregator or ("trimmed_mean" if byzantine else "fedavg"),
        steps=steps,
        codec=codec,
        byzantine=byzantine,
        byzantine_clients=byzantine_clients,
        workdir=workdir or Path(tempfile.mkdtemp(prefix="zoo-gym-demo-")),
        timeout=timeout,
        method=method,
        warmup=warmup,
    )


def _run_demo(plan: DemoPlan) -> list[dict[str, Any]]:
    """Run the federation, saying how each round went; then the table of rounds and every
    contributor's reward statement, verified against the ledger. Returns the round summaries."""
    from zoo_gym.simulation.demo import Federation

    work = plan.workdir
    with Federation(
        work,
        clients=plan.clients,
        rounds=plan.rounds,
        aggregator=plan.aggregator,
        steps=plan.steps,
        codec=plan.codec,
        byzantine=plan.byzantine or "",
        byzantine_clients=plan.byzantine_clients,
        stay=True,
        method=plan.method,
        warmup_rounds=plan.warmup,
    ) as fed:
        console.print(f"preparing tiny model and {fed.total_clients} data shards in {work} ...")
        fed.prepare()
        fed.start()
        console.print(
            f"coordinator on 127.0.0.1:{fed.port} (REST :{fed.rest_port}); "
            f"{plan.clients} clients{plan.attackers} joining; {plan.schedule}"
        )
        fed.wait(timeout_s=plan.timeout, on_round=lambda row: _show_round(plan, row))
        fed.wait_clients(60)
        rows = fed.summaries()
        scores = {}
        if plan.rl:  # each round's resulting model, scored on the validation set
            console.print("scoring each round's model on the validation set (greedy) ...")
            scores = fed.task_scores([r["published_version"] or r["base_version"] for r in rows])
        title = (
            f"zoo-gym demo: {plan.clients} clients{plan.attackers}, {plan.schedule}, "
            f"{plan.aggregator}, {plan.codec}"
        )
        console.print(_demo_table(rows, scores, title=title, objective=plan.objective))
        # each contributor's own statement, checked against the ledger
        for i in range(fed.total_clients):
            console.print(f"\n[bold]{fed.client_name(i)}[/bold]: gym-client rewards --verify")
            report = fed.reward_report(i, "--verify", width=max(console.width, 120))
            sys.stdout.write(report.stdout or report.stderr)
            sys.stdout.flush()
    return rows


def _show_round(plan: DemoPlan, row: dict[str, Any]) -> None:
    """One line for a round that closed."""
    reward = (
        f"mean reward {row['reward_before']:.4f} -> {row.get('mean_reward') or 0.0:.4f}, "
        if row.get("reward_before") is not None
        else ""
    )
    console.print(
        f"round {row['round']} ({plan.objective(row)}): {row['accepted']}/{row['participants']} accepted, "
        f"validation loss {row['loss_before']:.4f} -> {row['loss_after']:.4f}, {reward}"
        f"{row['published_version'] or row['status']}"
    )


def _print_summary(plan: DemoPlan, rows: list[dict[str, Any]]) -> None:
    """How far the RL rounds moved the validation reward, and the whole run the validation loss."""
    from zoo_gym.simulation.demo import GRPO_REWARDS

    rl_rows = [r for r in rows if r.get("reward_before") is not None]
    if rl_rows:  # the reward of the base the RL rounds started from and of the base they end on
        end = (
            rl_rows[-1]["mean_reward"]
            if rl_rows[-1]["status"] == "published"
            else rl_rows[-1]["reward_before"]
        )
        console.print(
            f"{plan.method} rounds {rl_rows[0]['round']}-{rl_rows[-1]['round']}: mean validation reward "
            f"({' + '.join(GRPO_REWARDS)}) {rl_rows[0]['reward_before']:.4f} -> {end or 0.0:.4f}"
        )
    if rows:
        console.print(
            f"validation loss {rows[0]['loss_before']:.4f} -> {rows[-1]['loss_after']:.4f} "
            f"over {len(rows)} rounds; logs and ledger in {plan.workdir}"
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


# `run`'s options for an existing Ray cluster
RayAddressOption = Annotated[
    str | None,
    typer.Option(help="engine ray: attach to the running Ray cluster here (auto or host:port)"),
]
StorageOption = Annotated[
    Path | None,
    typer.Option(
        help="engine ray: contributors' state under this directory, which every Ray node "
        "reaches (default: Ray's object store)"
    ),
]


# `run`'s options for the task and how its records are split across clients
TaskOption = Annotated[
    str | None, typer.Option(help="addition, or arithmetic (add, subtract, multiply, compare)")
]
PartitionOption = Annotated[
    str | None, typer.Option(help="how records are split: iid (round robin), dirichlet or labels")
]
AlphaOption = Annotated[
    float | None, typer.Option(help="Dirichlet concentration (--partition dirichlet)")
]
ClassesPerClientOption = Annotated[
    int | None, typer.Option(help="classes each client holds (--partition labels)")
]


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
    task: TaskOption = None,
    partition: PartitionOption = None,
    alpha: AlphaOption = None,
    classes_per_client: ClassesPerClientOption = None,
    f: Annotated[
        int | None, typer.Option("--f", help="Byzantine updates the rules tolerate")
    ] = None,
    engine: Annotated[
        str | None,
        typer.Option(
            help="inprocess, batched (contributors train together on one shared model) or ray"
        ),
    ] = None,
    jobs: Annotated[
        int | None, typer.Option(help="cells at once (inprocess, ray); also a local Ray's CPUs")
    ] = None,
    ray_address: RayAddressOption = None,
    storage: StorageOption = None,
    seed: Annotated[int | None, typer.Option(help="seed for data, attackers and training")] = None,
    out: Annotated[
        Path, typer.Option(help="directory for results.csv, results.md and the plots")
    ] = Path("sim-results"),
) -> None:
    """Run an attack matrix (aggregators x attacks x Byzantine shares) and write tables and plots."""
    setup_logging(False)
    # after flwr's import: one warning per federation otherwise
    logging.getLogger("flwr").setLevel(logging.ERROR)
    flags = {
        "aggregators": aggregators and _items(aggregators),
        "attacks": attacks and _items(attacks),
        "byzantine_shares": shares and _shares(shares),
        "clients": clients,
        "rounds": rounds,
        "steps": steps,
        "task": task,
        "partition": partition,
        "alpha": alpha,
        "classes_per_client": classes_per_client,
        "f": f,
        "engine": engine,
        "jobs": jobs,
        "ray_address": ray_address,
        "storage": storage,
        "seed": seed,
    }
    sweep = _load(config, flags)
    _report(_run_sweep(sweep, out), sweep, out)


def _load(config: Path | None, flags: dict[str, Any]) -> SweepConfig:
    """The sweep in `config` (or the defaults) with the flags that were given on top."""
    from zoo_gym.simulation.sweep import load_sweep

    return load_sweep(config, {k: v for k, v in flags.items() if v is not None})


def _report(results: list[CellResult], sweep: SweepConfig, out: Path) -> None:
    """Write the sweep's tables and plots to `out` and show its Markdown table."""
    from rich.markdown import Markdown

    from zoo_gym.simulation.report import write_report

    paths = write_report(results, sweep, out)
    console.print(Markdown((out / "results.md").read_text()))
    console.print("wrote " + ", ".join(str(p) for p in paths))


def _items(value: str) -> list[str]:
    """The items of a comma-separated flag."""
    return [v.strip() for v in value.split(",") if v.strip()]


def _shares(value: str) -> list[float]:
    """The numbers of `--shares`."""
    from zoo_gym.simulation.sweep import SweepError

    try:
        return [float(v) for v in _items(value)]
    except ValueError:
        raise SweepError(f"--shares takes numbers like 0.1,0.2,0.3, not {value!r}") from None


def _run_sweep(sweep: SweepConfig, out: Path) -> list[CellResult]:
    """Every federation of `sweep`, with a progress bar and one line per federation done."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from zoo_gym.simulation.experiment import run_sweep

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

        return run_sweep(sweep, out / "work", on_result=show)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
