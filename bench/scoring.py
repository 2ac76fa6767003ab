"""Benchmark: cost of scoring one round's contributions on the tiny model, and how well
`first_order` and `leave_one_out` rank contributions the way `individual` does.

The coordinator is the tiny demo one (`zoo_gym.coordinator.setup.init_home(tiny=True)`, default
policy: FFA-LoRA rank 8 on q/k/v/o/gate/up/down, max length 96, 200 validation records). The
base state, the round's update layout and the utility are built as `zoo_gym.coordinator.rounds`
builds them: `lora_spec`, `update_layout`, round seed `round_seed(seed, round)`, and the
round's own `zoo_gym.coordinator.payout.RoundScorer`:

    U(v) = -Evaluator.loss(base with W + s B A for the B of v)

(the touched weights merged with the round's frozen A, loaded into the one evaluation model,
mean completion NLL over the round's validation subset: all 200 records here, as
`scoring_examples` = 256), and grad U(0) from one backward pass at the base
(`RoundScorer.gradient`). `aggregate_fn` is the configured rule through
`zoo_gym.aggregation.aggregate(rule, rows, f=0)`, for fedavg and median (unweighted: every
simulated contributor trains on the same number of examples).

Cost (default): two real contributor updates are trained first with the client's trainer
(`FfaLoraTrainer.train_round`, the default policy's 30 steps of batch 8, lr 0.005, 120
synthetic records each). The n updates of a round are their mean g plus independent Gaussian
noise whose norm equals the measured spread ||u_1 - g||. Timed per round:
`score_contributions(updates, method=...)` for `individual` (n + 1 utility evaluations),
`leave_one_out`, `gtg_shapley` (default tolerances; above `--gtg-full-up-to` contributions
`max_permutations` is capped at `--gtg-cap`) and `first_order` (one backward pass), each with
torch threads 1 and 2. "s / utility eval" is the wall time inside U per call (for
`first_order`: of its one backward pass). The anchor is one evaluation of the merged
aggregate, what the round itself already spends on its quality gate.

Agreement (`--agreement`): per seed, a round of real contributions trained with the client's
trainer on disjoint shards: `--honest-steps` honest ones (one per entry, that many steps:
contributors who did more or less work) and four bad ones: one trained on the same task with
wrong answers (label flip), the sign-flipped longest honest update, Gaussian noise of its norm,
and that update scaled by `--scale` (an overshoot). Each seed is its own round (round number =
seed + 1: its own frozen A, data and noise). Printed: Spearman's rank correlation
(`scipy.stats.spearmanr`) of `first_order` and of `leave_one_out` (fedavg, median) with
`individual`, over all contributions and over the honest ones alone, how many of the four bad
ones each method ranks lowest, and the time of each method.

    python bench/scoring.py                          # cost: 10 and 100 contributions, threads 1 and 2
    python bench/scoring.py --contributions 10 --threads 1 --methods individual,first_order
    python bench/scoring.py --agreement --seeds 0,1,2,3,4
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from zoo_gym.aggregation import aggregate
from zoo_gym.coordinator.config import CoordinatorConfig, load_config
from zoo_gym.coordinator.evaluation import Evaluator
from zoo_gym.coordinator.payout import RoundScorer
from zoo_gym.coordinator.registry import ModelRegistry
from zoo_gym.coordinator.rounds import lora_spec, round_seed, update_layout
from zoo_gym.coordinator.setup import init_home
from zoo_gym.core.delta import Layout, flatten, numel
from zoo_gym.core.identity import Identity
from zoo_gym.core.lora import LoraSpec
from zoo_gym.scoring import Quality, score_contributions

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
EXAMPLES_PER_CLIENT = 120


@dataclass
class Round:
    """What scoring a round needs: the base, its layout, the frozen-A seed and the evaluator."""

    config: CoordinatorConfig
    state: dict[str, Tensor]
    spec: LoraSpec
    layout: Layout
    seed: int
    evaluator: Evaluator
    model_dir: Path

    def scorer(self) -> RoundScorer:
        """The round's own scorer: U and grad U(0) on the round's validation subset."""
        return RoundScorer(
            self.evaluator,
            self.config.training,
            self.state,
            self.layout,
            self.spec,
            seed=self.seed,
            subset_seed=self.seed,
            examples=self.config.rewards.scoring_examples,
            baseline=None,
        )


def build_round(home: Path) -> Round:
    """The tiny coordinator's base and round 1, loaded as `rounds.run_rounds` loads them."""
    config_path, _signer, _published = init_home(home, tiny=True, settings="")
    config = load_config(config_path)
    registry = ModelRegistry(config.path("models"), Identity.load(config.path(config.signing_key)))
    base = registry.latest()
    state = registry.load_state_dict(base.version)
    spec = lora_spec(config.training)
    layout = update_layout(state, spec)  # type: ignore[arg-type]
    evaluator = Evaluator(
        base.directory,
        config.path(config.validation_data),
        max_length=config.training.max_length,
    )
    seed = round_seed(config.seed, 1)
    return Round(config, state, spec, layout, seed, evaluator, base.directory)


def make_trainer(r: Round) -> Any:
    """The client's FFA-LoRA trainer on a fresh copy of the base."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from zoo_gym.client.trainers.sft import FfaLoraTrainer

    model = AutoModelForCausalLM.from_pretrained(r.model_dir, dtype=torch.float32)
    return FfaLoraTrainer(model, AutoTokenizer.from_pretrained(r.model_dir), spec=r.spec)


def train(r: Round, trainer: Any, records: list[dict[str, str]], *, steps: int) -> Tensor:
    """One contributor's real FFA-LoRA update `(d,)`: `steps` steps on `records` in round `r`."""
    from zoo_gym.core.chat import to_conversation

    t = r.config.training
    result = trainer.train_round(
        [to_conversation(x) for x in records],
        seed=r.seed,
        steps=steps,
        lr=t.learning_rate,
        batch_size=t.batch_size,
        max_length=t.max_length,
    )
    return flatten(result.update, r.layout)


def trained_updates(r: Round, clients: int = 2) -> list[Tensor]:
    """`clients` real FFA-LoRA updates `(d,)` from the client's trainer on disjoint shards."""
    from zoo_gym.core.synthetic import make_examples, shard

    trainer = make_trainer(r)
    records = shard(make_examples(clients * EXAMPLES_PER_CLIENT, seed=1), clients)
    return [train(r, trainer, shard_, steps=r.config.training.steps) for shard_ in records]


def round_updates(real: list[Tensor], n: int, *, seed: int) -> Tensor:
    """`(n, d)` updates: the mean g of the real ones plus Gaussian noise of norm ||u_1 - g||."""
    g = torch.stack(real).mean(dim=0)  # (d,)
    spread = float((real[0] - g).norm())
    generator = torch.Generator().manual_seed(seed)
    noise = torch.randn((n, g.numel()), generator=generator)  # (n, d)
    noise *= spread / noise.norm(dim=1, keepdim=True)
    return g + noise


@dataclass
class TimedUtility:
    """The round's U(v) and grad U(0) (`RoundScorer`), timing every call."""

    r: Round
    seconds: float = 0.0
    calls: int = 0

    def __post_init__(self) -> None:
        self.scorer = self.r.scorer()

    def __call__(self, vector: Tensor) -> float:
        start = time.perf_counter()
        value = self.scorer.utility(vector)
        self.seconds += time.perf_counter() - start
        self.calls += 1
        return value

    def gradient(self) -> Tensor:
        start = time.perf_counter()
        g = self.scorer.gradient()
        self.seconds += time.perf_counter() - start
        self.calls += 1
        return g


def aggregate_fn(rule: str) -> Callable[[Tensor], Tensor]:
    """The round's rule on a subset of rows, `(k, d) -> (d,)`."""
    return lambda rows: aggregate(rule, rows, f=0).vector.float()


@dataclass(frozen=True)
class Row:
    threads: int
    n: int
    method: str
    rule: str
    params: str
    seconds: float
    utility_seconds: float
    quality: Quality


def score(r: Round, updates: Tensor, *, method: str, rule: str, params: dict[str, Any]) -> Row:
    utility = TimedUtility(r)
    start = time.perf_counter()
    own = method in ("individual", "first_order")  # no aggregation rule involved
    quality = score_contributions(
        updates,
        utility=utility,
        method=method,
        aggregate_fn=None if own else aggregate_fn(rule),
        gradient=utility.gradient,
        **params,
    )
    seconds = time.perf_counter() - start
    shown = ", ".join(f"{k}={v}" for k, v in params.items()) or "defaults"
    return Row(
        torch.get_num_threads(),
        updates.shape[0],
        method,
        "-" if own else rule,
        shown,
        seconds,
        utility.seconds / max(utility.calls, 1),
        quality,
    )


def anchor_seconds(r: Round, updates: Tensor, repeats: int = 5) -> float:
    """Median time of one evaluation of the merged fedavg aggregate (the round's quality gate)."""
    utility = TimedUtility(r)
    vector = aggregate("fedavg", updates, f=0).vector.float()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        utility(vector)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def table(rows: list[Row], anchors: dict[tuple[int, int], float]) -> str:
    lines = [
        "| torch threads | contributions | method | aggregate_fn | options | s / round "
        "| utility evals | aggregations | backward passes | permutations | s / utility eval "
        "| x round's own eval |",
        "|---:|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        q = row.quality
        perms = f"{q.permutations}" + ("" if q.converged else " (not converged)")
        if q.method != "gtg_shapley":
            perms = "-"
        elif q.note.startswith("between-round"):
            perms = "0 (between-round truncation)"
        lines.append(
            f"| {row.threads} | {row.n} | {row.method} | {row.rule} | {row.params} | "
            f"{row.seconds:,.1f} | {q.utility_calls} | {q.aggregations} | {q.backward_passes} | "
            f"{perms} | "
            f"{row.utility_seconds:.3f} | {row.seconds / anchors[(row.threads, row.n)]:,.0f} |"
        )
    return "\n".join(lines)


# -- agreement with `individual` ------------------------------------------------------------------

BAD = ("label flip", "sign flip", "noise", "scaled")


def wrong_answers(records: list[dict[str, str]], *, seed: int) -> list[dict[str, str]]:
    """The same questions with every answer off by 1 to 9 (a poisoned data set)."""
    generator = torch.Generator().manual_seed(seed)
    offsets = torch.randint(1, 10, (len(records),), generator=generator)
    return [
        {**x, "output": str(int(x["output"]) + int(k))}
        for x, k in zip(records, offsets, strict=True)
    ]


def round_contributions(
    r: Round, trainer: Any, *, seed: int, honest_steps: list[int], scale: float
) -> tuple[Tensor, list[str]]:
    """`(n, d)` real contributions of one round and the kind of each: honest ones after
    `honest_steps` steps, then the four `BAD` ones (see the module docstring)."""
    from zoo_gym.core.synthetic import make_examples, shard

    shards = shard(
        make_examples((len(honest_steps) + 1) * 60, seed=100 + seed), len(honest_steps) + 1
    )
    rows = [train(r, trainer, x, steps=k) for x, k in zip(shards, honest_steps, strict=False)]
    longest = rows[max(range(len(rows)), key=lambda i: honest_steps[i])]
    poisoned = wrong_answers(shards[-1], seed=seed)
    noise = torch.randn(longest.numel(), generator=torch.Generator().manual_seed(seed))
    rows += [
        train(r, trainer, poisoned, steps=max(honest_steps)),
        -longest,
        noise * (longest.norm() / noise.norm()),
        scale * longest,
    ]
    kinds = [f"honest, {k} steps" for k in honest_steps] + list(BAD)
    return torch.stack(rows), kinds


def spearman(a: tuple[float, ...], b: tuple[float, ...]) -> float:
    from scipy.stats import spearmanr

    return float(spearmanr(a, b).statistic)


def bad_lowest(scores: tuple[float, ...], kinds: list[str]) -> int:
    """How many of the bad contributions are among the len(BAD) lowest scores."""
    lowest = sorted(range(len(scores)), key=lambda i: scores[i])[: len(BAD)]
    return sum(kinds[i] in BAD for i in lowest)


@dataclass(frozen=True)
class Agreement:
    seed: int
    kinds: list[str]
    qualities: dict[str, Quality]  # method label -> its scores and cost


def agreement_round(
    r: Round, trainer: Any, *, seed: int, honest_steps: list[int], scale: float
) -> Agreement:
    """Train one round's contributions and score them by every method."""
    rows, kinds = round_contributions(r, trainer, seed=seed, honest_steps=honest_steps, scale=scale)
    scorer = TimedUtility(r)
    qualities = {
        "individual": score_contributions(rows, utility=scorer, method="individual"),
        "first_order": score_contributions(
            rows, utility=scorer, method="first_order", gradient=scorer.gradient
        ),
    }
    for rule in ("fedavg", "median"):
        qualities[f"leave_one_out ({rule})"] = score_contributions(
            rows, utility=scorer, method="leave_one_out", aggregate_fn=aggregate_fn(rule)
        )
    return Agreement(seed, kinds, qualities)


def rho(result: Agreement, label: str, rows: list[int]) -> float:
    """Spearman of method `label` with individual over the contributions `rows`."""
    scores = result.qualities[label].scores
    reference = result.qualities["individual"].scores
    return spearman(tuple(scores[i] for i in rows), tuple(reference[i] for i in rows))


def agreement_table(results: list[Agreement]) -> str:
    honest = [i for i, kind in enumerate(results[0].kinds) if kind not in BAD]
    lines = [
        "| method | Spearman vs individual, all (per seed) | mean | all but the overshoot | mean "
        "| honest only (per seed) | mean | bad among the 4 lowest (per seed) | s / round (mean) "
        "| evaluations | backward passes |",
        "|---|---|---:|---|---:|---|---:|---|---:|---:|---:|",
    ]
    for label in results[0].qualities:
        every = [
            spearman(a.qualities[label].scores, a.qualities["individual"].scores) for a in results
        ]
        within = [rho(a, label, honest) for a in results]
        no_overshoot = [
            rho(a, label, [i for i, k in enumerate(a.kinds) if k != "scaled"]) for a in results
        ]
        lowest = [bad_lowest(a.qualities[label].scores, a.kinds) for a in results]
        q = results[0].qualities[label]
        seconds = sum(a.qualities[label].seconds for a in results) / len(results)
        lines.append(
            f"| {label} | {', '.join(f'{x:.2f}' for x in every)} | {sum(every) / len(every):.2f} "
            f"| {', '.join(f'{x:.2f}' for x in no_overshoot)} "
            f"| {sum(no_overshoot) / len(no_overshoot):.2f} "
            f"| {', '.join(f'{x:.2f}' for x in within)} | {sum(within) / len(within):.2f} "
            f"| {', '.join(map(str, lowest))} | {seconds:.2f} | {q.utility_calls} | {q.backward_passes} |"
        )
    return "\n".join(lines)


def scores_table(result: Agreement) -> str:
    labels = list(result.qualities)
    lines = [
        "| contribution | " + " | ".join(labels) + " |",
        "|---|" + "---:|" * len(labels),
    ]
    for i, kind in enumerate(result.kinds):
        cells = " | ".join(f"{result.qualities[x].scores[i]:+.4f}" for x in labels)
        lines.append(f"| {kind} | {cells} |")
    return "\n".join(lines)


def main_agreement(args: argparse.Namespace) -> None:
    seeds = [int(x) for x in args.seeds.split(",")]
    honest_steps = [int(x) for x in args.honest_steps.split(",")]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="zoo-bench-scoring-") as tmp:
        torch.set_num_threads(args.agreement_threads)
        first = build_round(Path(tmp) / "home")
        trainer = make_trainer(first)
        results = []
        for seed in seeds:
            r = replace(first, seed=round_seed(first.config.seed, seed + 1))
            results.append(
                agreement_round(r, trainer, seed=seed, honest_steps=honest_steps, scale=args.scale)
            )
            print(f"seed {seed} done at {time.perf_counter() - started:.0f}s", flush=True)
    print()
    print(f"Scores of seed {seeds[0]} (utility units: minus validation loss):")
    print()
    print(scores_table(results[0]))
    print()
    print(
        f"{len(honest_steps)} honest + {len(BAD)} bad contributions per round, seeds "
        f"{args.seeds}, torch threads {args.agreement_threads}:"
    )
    print()
    print(agreement_table(results))
    print()
    print(f"wall time {time.perf_counter() - started:.0f}s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contributions", default="10,100", help="n per round, comma separated")
    parser.add_argument("--threads", default="1,2", help="torch threads, comma separated")
    parser.add_argument("--methods", default="individual,leave_one_out,gtg_shapley,first_order")
    parser.add_argument("--rules", default="fedavg,median", help="aggregation rules")
    parser.add_argument(
        "--gtg-full-up-to",
        type=int,
        default=20,
        help="run gtg_shapley with its default max_permutations up to this many contributions",
    )
    parser.add_argument("--gtg-cap", type=int, default=10, help="max_permutations above that")
    parser.add_argument(
        "--agreement", action="store_true", help="rank agreement with individual instead of cost"
    )
    parser.add_argument("--seeds", default="0,1,2,3,4", help="agreement: one round per seed")
    parser.add_argument(
        "--honest-steps",
        default="2,4,6,8,12,16,24,30",
        help="agreement: one honest contributor per entry, trained that many steps",
    )
    parser.add_argument("--scale", type=float, default=8.0, help="agreement: the overshoot")
    parser.add_argument("--agreement-threads", type=int, default=1, help="agreement: torch threads")
    args = parser.parse_args(argv)
    if args.agreement:
        main_agreement(args)
        return 0
    sizes = [int(x) for x in args.contributions.split(",")]
    threads = [int(x) for x in args.threads.split(",")]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    rules = [x.strip() for x in args.rules.split(",") if x.strip()]

    with tempfile.TemporaryDirectory(prefix="zoo-bench-scoring-") as tmp:
        torch.set_num_threads(1)
        r = build_round(Path(tmp) / "home")
        start = time.perf_counter()
        real = trained_updates(r)
        print(
            f"trained 2 real updates in {time.perf_counter() - start:.1f}s; d = {numel(r.layout)}, "
            f"norms {float(real[0].norm()):.4f} and {float(real[1].norm()):.4f}, "
            f"spread ||u_1 - mean|| {float((real[0] - real[1]).norm()) / 2:.4f}",
            flush=True,
        )
        utility = TimedUtility(r)
        base_u = utility(torch.zeros(numel(r.layout)))
        print(
            f"validation loss: base {-base_u:.4f}, real updates "
            f"{-utility(real[0]):.4f} and {-utility(real[1]):.4f}",
            flush=True,
        )
        rows: list[Row] = []
        anchors: dict[tuple[int, int], float] = {}
        for t in threads:
            torch.set_num_threads(t)
            for n in sizes:
                updates = round_updates(real, n, seed=n)
                anchors[(t, n)] = anchor_seconds(r, updates)
                for method in methods:
                    params: dict[str, Any] = {}
                    if method == "gtg_shapley" and n > args.gtg_full_up_to:
                        params["max_permutations"] = args.gtg_cap
                    own = method in ("individual", "first_order")
                    for rule in rules[:1] if own else rules:
                        row = score(r, updates, method=method, rule=rule, params=params)
                        rows.append(row)
                        q = row.quality
                        print(
                            f"threads {t} n {n} {method} {row.rule}: {row.seconds:.1f}s, "
                            f"{q.utility_calls} utility calls, {q.permutations} permutations "
                            f"{q.note}",
                            flush=True,
                        )
    print()
    print(
        "Anchor (one evaluation of the merged aggregate, as the round's quality gate does): "
        + ", ".join(f"threads {t}, n {n}: {s * 1000:.0f} ms" for (t, n), s in anchors.items())
    )
    print()
    print(table(rows, anchors))
    return 0


if __name__ == "__main__":
    sys.exit(main())
