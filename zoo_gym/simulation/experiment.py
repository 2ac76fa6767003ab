"""Attack matrices: aggregators x attacks x Byzantine shares, each cell a whole federation.

Every cell runs the deployment round loop (intake, aggregation, ledger, merge) for
`rounds` rounds with `clients` virtual contributors on the tiny model and the
synthetic addition task, `round(share * clients)` of them Byzantine. Each aggregator
also runs once with no attack: its baseline.

Every cell starts from the same warmed-up base: `warmup_rounds` honest FedAvg rounds
on the sweep's data, run once. They take the tiny model past the quick phase in which
it learns the answer format (any update direction helps there, which would hide an
attack's effect). Quality of a run is how far it lowered the validation loss from that
start, q = L_0 - L_R; a cell's relative quality is q / q_baseline of the same
aggregator (1.0 = the attack did no harm; 0 = no progress at all; negative = worse
than the start). Everything is derived from `seed`: data, Byzantine clients, LoRA
seeds and attack randomness, so a sweep is reproducible.

The rule tolerates `f` Byzantine updates in every cell, by default the number of
attackers at the largest share: the defence is configured once, as an operator
would, not per attack.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import math
import multiprocessing
import shutil
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from zoo_gym import ledger
from zoo_gym.ledger import Session
from zoo_gym.simulation.sweep import (
    Cell,
    CellResult,
    SweepConfig,
    byzantine_indices,
    cell_overrides,
    shards_for,
    validation_records,
)

if TYPE_CHECKING:
    from zoo_gym.coordinator.rounds import RoundSummary
    from zoo_gym.coordinator.service import Coordinator

log = logging.getLogger(__name__)


def make_template(workdir: Path, config: SweepConfig) -> Path:
    """The coordinator home every cell copies: the tiny model, tokenizer and the task's validation
    split, after `warmup_rounds` honest FedAvg rounds on the sweep's data (published as v0001, ...)."""
    from zoo_gym.coordinator.setup import init_home
    from zoo_gym.core.synthetic import write_jsonl
    from zoo_gym.simulation.batched import BatchedFederation
    from zoo_gym.simulation.inprocess import InProcessFederation

    key = (
        f"{config.seed}|{config.clients}|{config.examples_per_client}|{config.warmup_rounds}|{config.steps}|"
        f"{config.learning_rate}|{config.batch_size}|{config.codec}|{config.task}|{config.partition}|"
        f"{config.alpha}|{config.classes_per_client}|{json.dumps(config.coordinator, sort_keys=True)}"
    )
    if config.engine == "batched":  # its warm-up trains batched too (the same up to rounding)
        key += "|batched"
    template = workdir / f"template-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    if (template / "coordinator.toml").exists():
        return template
    building = template.with_name(template.name + ".part")
    shutil.rmtree(building, ignore_errors=True)
    init_home(building, tiny=True, settings="", seed=config.seed)
    validation = validation_records(config)
    if validation is not None:
        write_jsonl(validation, building / "validation.jsonl")
    if config.warmup_rounds:
        overrides = {
            **cell_overrides(config, Cell("fedavg", "none", 0.0)),
            "rounds": config.warmup_rounds,
            "byzantine_f": 0,
            "aggregator_params": {},
            "pre_aggregation": "none",
        }
        federation = BatchedFederation if config.engine == "batched" else InProcessFederation
        fed = federation.build(building, shards_for(config), overrides=overrides, seed=config.seed)
        fed.run()
        fed.coordinator.engine.dispose()
        shutil.rmtree(building / "clients", ignore_errors=True)
    building.rename(template)
    return template


def run_cell(config: SweepConfig, cell: Cell, template: Path, workdir: Path) -> CellResult:
    """One federation: copy the template home, run it, read the outcome from its ledger."""
    if config.engine == "ray":
        return run_ray_cells(config, [cell], template, workdir)[0]
    home = fresh_home(template, workdir, cell)
    attackers = byzantine_indices(config, cell.share) if cell.attack != "none" else []
    started = time.perf_counter()
    summaries, co, bad = run_local_federation(config, cell, home, attackers)
    return cell_result(config, cell, summaries, co, bad, seconds=time.perf_counter() - started)


def fresh_home(template: Path, workdir: Path, cell: Cell) -> Path:
    """The coordinator home of `cell`: a copy of the template, nothing left of an earlier run."""
    home = workdir / "cells" / cell.name
    shutil.rmtree(home, ignore_errors=True)
    shutil.copytree(template, home)
    return home


def cell_result(
    config: SweepConfig,
    cell: Cell,
    summaries: list[RoundSummary],
    co: Coordinator,
    bad: set[str],
    *,
    seconds: float,
) -> CellResult:
    """What a cell's rounds and its ledger say about the rule under its attack."""
    if not summaries:
        raise RuntimeError(f"cell {cell.name} ran no round; see its coordinator home under cells/")
    rounds = {s.round for s in summaries}  # the cell's own, not the template's warm-up
    with Session(co.engine) as session:
        subs = [
            s
            for s in ledger.list_submissions(session)
            if s.contributor_id in bad and s.round_number in rounds
        ]
    co.engine.dispose()  # a worker runs many cells: close this one's database connections
    selected = sum(1 for s in subs if s.selected) / len(subs) if subs else 0.0
    return CellResult(
        aggregator=cell.aggregator,
        attack=cell.attack,
        byzantine_share=cell.share,
        byzantine_clients=config.attackers(cell.share) if cell.attack != "none" else 0,
        f=config.tolerated,
        losses=(
            summaries[0].loss_before,
            *(s.loss_after if s.status == "published" else s.loss_before for s in summaries),
        ),
        published=sum(1 for s in summaries if s.status == "published"),
        byzantine_selected=selected,
        seconds=seconds,
    )


def run_ray_cells(
    config: SweepConfig,
    cells: list[Cell],
    template: Path,
    workdir: Path,
    on_result: Callable[[CellResult], None] | None = None,
) -> list[CellResult]:
    """`cells` on Flower's simulation engine, `config.jobs` at a time, in one federation over
    the local Ray or the cluster at `config.ray_address` (see `ray_engine`)."""
    from zoo_gym.simulation.ray_engine import CellRun, run_on_ray

    results: dict[Cell, CellResult] = {}

    def done(run: CellRun) -> None:
        result = cell_result(
            config, run.cell, run.summaries, run.coordinator, run.byzantine, seconds=run.seconds
        )
        results[run.cell] = result
        if on_result is not None:
            on_result(result)

    run_on_ray(
        config,
        cells,
        template=template,
        home_of=lambda cell: fresh_home(template, workdir, cell),
        on_done=done,
    )
    return [results[c] for c in cells]


def run_local_federation(
    config: SweepConfig, cell: Cell, home: Path, attackers: list[int]
) -> tuple[list[RoundSummary], Coordinator, set[str]]:
    """One cell in this process, on the in-process or the batched engine: its rounds, its
    coordinator and the contributor ids of its attackers."""
    from zoo_gym.simulation.batched import BatchedFederation
    from zoo_gym.simulation.inprocess import InProcessFederation

    federation = BatchedFederation if config.engine == "batched" else InProcessFederation
    fed = federation.build(
        home,
        shards_for(config),
        overrides=cell_overrides(config, cell),
        byzantine=attackers,
        attack=cell.attack,
        attack_params=config.attack_params.get(cell.attack, {}),
        seed=config.seed,
    )
    return fed.run(), fed.coordinator, set(fed.byzantine.values())


def _worker_init() -> None:
    torch.set_num_threads(1)
    logging.getLogger().setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")


def _run_in_worker(config: SweepConfig, cell: Cell, template: Path, workdir: Path) -> CellResult:
    return run_cell(config, cell, template, workdir)


def run_sweep(
    config: SweepConfig, workdir: Path, *, on_result: Callable[[CellResult], None] | None = None
) -> list[CellResult]:
    """Every cell of `config`, in `config.cells()` order; `on_result` sees each as it finishes."""
    if config.engine == "ray":  # a wrong address or storage: one line now, not after the warm-up
        from zoo_gym.simulation.ray_engine import check_cluster

        check_cluster(config)
    workdir.mkdir(parents=True, exist_ok=True)
    template = make_template(workdir, config)
    cells = list(config.cells())
    if config.engine == "ray":
        return run_ray_cells(config, cells, template, workdir, on_result)
    results: dict[Cell, CellResult] = {}

    def done(cell: Cell, result: CellResult) -> None:
        results[cell] = result
        if on_result is not None:
            on_result(result)

    if config.jobs == 1 or config.engine == "batched":
        for cell in cells:
            done(cell, run_cell(config, cell, template, workdir))
    else:
        context = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(
            config.jobs, mp_context=context, initializer=_worker_init
        ) as pool:
            futures = {pool.submit(_run_in_worker, config, c, template, workdir): c for c in cells}
            for future in concurrent.futures.as_completed(futures):
                done(futures[future], future.result())
    return [results[c] for c in cells]


def as_row(result: CellResult, baseline: CellResult | None) -> dict[str, Any]:
    """One CSV row: the result, its quality and its quality relative to the baseline."""
    row = asdict(result)
    row["losses"] = " ".join(f"{x:.5f}" for x in result.losses)
    row["initial_loss"] = result.losses[0]
    row["final_loss"] = result.losses[-1]
    row["quality"] = result.quality
    row["relative_quality"] = relative(result, baseline)
    return row


def relative(result: CellResult, baseline: CellResult | None) -> float:
    if baseline is None or baseline.quality <= 0:
        return math.nan
    return result.quality / baseline.quality
