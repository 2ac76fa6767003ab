"""Tables and plots of an attack matrix: `results.csv`, `results.md` and one PNG per share."""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from pathlib import Path

from zoo_gym.simulation.experiment import as_row, relative
from zoo_gym.simulation.sweep import CellResult, SweepConfig

COLUMNS = (
    "aggregator",
    "attack",
    "byzantine_share",
    "byzantine_clients",
    "f",
    "initial_loss",
    "final_loss",
    "quality",
    "relative_quality",
    "byzantine_selected",
    "published",
    "seconds",
    "losses",
)


def baselines(results: Sequence[CellResult]) -> dict[str, CellResult]:
    """The no-attack run of each aggregator."""
    return {r.aggregator: r for r in results if r.attack == "none"}


def write_csv(results: Sequence[CellResult], path: Path) -> None:
    base = baselines(results)
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for r in results:
            writer.writerow(as_row(r, base.get(r.aggregator)))


def data_split(config: SweepConfig) -> str:
    """How the sweep's records are split, in words.

    >>> data_split(SweepConfig(partition="labels", classes_per_client=2))
    '2 classes per client'
    """
    if config.partition == "dirichlet":
        return f"Dirichlet alpha = {config.alpha:g} split"
    if config.partition == "labels":
        k = config.classes_per_client
        return f"{k} class{'es' if k > 1 else ''} per client"
    return "IID split"


def _pct(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{100 * value:.0f}%"


def _quality(result: CellResult, baseline: CellResult | None) -> str:
    """Relative quality, or the cell's own quality where the baseline gives no scale."""
    share = relative(result, baseline)
    return f"q {result.quality:+.3f}" if math.isnan(share) else _pct(share)


def markdown(results: Sequence[CellResult], config: SweepConfig) -> str:
    """Relative quality per aggregator and attack (rows) and Byzantine share (columns)."""
    base = baselines(results)
    shares = sorted({r.byzantine_share for r in results if r.attack != "none"})
    by_cell = {(r.aggregator, r.attack, r.byzantine_share): r for r in results}
    lines = [
        f"Relative quality: validation-loss reduction under attack / without attack, same aggregator "
        f"({config.task} task, {data_split(config)}, {config.clients} clients, {config.rounds} rounds "
        f"after {config.warmup_rounds} honest warm-up rounds, f = {config.tolerated}, seed {config.seed}). "
        "100% = no harm; 0% = no progress; negative = worse than the start. "
        "Where a rule made no progress without attack, its cells give their own quality "
        "q = L_0 - L_R (loss reduction) instead. "
        "In brackets: share of Byzantine updates the rule selected.",
        "",
        "| aggregator | attack | "
        + " | ".join(f"{round(100 * s)}% Byzantine" for s in shares)
        + " |",
        "|---|---|" + "---:|" * len(shares),
    ]
    for rule in dict.fromkeys(r.aggregator for r in results):
        baseline = base.get(rule)
        if baseline is not None:
            lines.append(
                f"| {rule} | none | loss {baseline.losses[0]:.3f} -> {baseline.losses[-1]:.3f} |"
                + " |" * (len(shares) - 1)
            )
        for attack in dict.fromkeys(r.attack for r in results if r.attack != "none"):
            cells = []
            for share in shares:
                r = by_cell.get((rule, attack, share))
                cells.append(
                    "" if r is None else f"{_quality(r, baseline)} ({_pct(r.byzantine_selected)})"
                )
            lines.append(f"| {rule} | {attack} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(results: Sequence[CellResult], directory: Path) -> list[Path]:
    """One PNG per Byzantine share: validation loss across rounds, a panel per aggregator,
    a line per attack plus the no-attack baseline."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    base = baselines(results)
    rules = list(dict.fromkeys(r.aggregator for r in results))
    attacks = list(dict.fromkeys(r.attack for r in results if r.attack != "none"))
    paths = []
    for share in sorted({r.byzantine_share for r in results if r.attack != "none"}):
        cols = min(3, len(rules))
        rows = math.ceil(len(rules) / cols)
        fig = Figure(figsize=(4.2 * cols, 3.2 * rows), layout="constrained")
        axes = fig.subplots(
            rows, cols, squeeze=False
        )  # own y scale: one divergent run must not flatten the rest
        for ax, rule in zip(axes.flat, rules, strict=False):
            if rule in base:
                ax.plot(range(len(base[rule].losses)), base[rule].losses, "k--", label="no attack")
            for attack in attacks:
                for r in results:
                    if (r.aggregator, r.attack, r.byzantine_share) == (rule, attack, share):
                        ax.plot(
                            range(len(r.losses)), r.losses, marker="o", markersize=3, label=attack
                        )
            ax.set_title(rule)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_xlabel("round")
            ax.set_ylabel("validation loss")
            ax.grid(alpha=0.3)
        for ax in list(axes.flat)[len(rules) :]:
            ax.set_visible(False)
        axes.flat[0].legend(fontsize="small")
        fig.suptitle(f"validation loss under attack, {round(100 * share)}% Byzantine clients")
        path = directory / f"loss_byzantine_{round(100 * share):02d}.png"
        fig.savefig(path, dpi=110)
        paths.append(path)
    return paths


def write_report(results: Sequence[CellResult], config: SweepConfig, directory: Path) -> list[Path]:
    """results.csv, results.md and the plots in `directory`; returns their paths."""
    directory.mkdir(parents=True, exist_ok=True)
    write_csv(results, directory / "results.csv")
    (directory / "results.md").write_text(markdown(results, config))
    return [directory / "results.csv", directory / "results.md", *plot(results, directory)]
