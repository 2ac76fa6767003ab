"""Benchmark: cost of scoring one round's contributions on the tiny model.

The coordinator is the tiny demo one (`zoo_gym.coordinator.setup.init_home(tiny=True)`, default
policy: FFA-LoRA rank 8 on q/k/v/o/gate/up/down, max length 96, 200 validation records). The
base state, the round's update layout and the utility are built as `zoo_gym.coordinator.rounds`
builds them: `lora_spec`, `update_layout`, round seed `round_seed(seed, 1)`, and

    U(v) = -Evaluator.loss(base with merge_ffa(unflatten(v, layout)))

(clone the base state, merge the B update with the round's frozen A, load it into the one
evaluation model, mean completion NLL over the validation set). `aggregate_fn` is the configured
rule through `zoo_gym.aggregation.aggregate(rule, rows, f=0)`, for fedavg and median (unweighted:
every simulated contributor trains on the same number of examples).

Updates: two real contributor updates are trained first with the client's trainer
(`FfaLoraTrainer.train_round`, the default policy's 30 steps of batch 8, lr 0.005, 120 synthetic
records each). The n updates of a round are their mean g plus independent Gaussian noise whose
norm equals the measured spread ||u_1 - g||: real magnitude and real direction, isotropic
disagreement between contributors (an assumption; real disagreement is not isotropic).

Timed per round: `score_contributions(updates, method=...)` for `individual` (n + 1 utility
evaluations), `leave_one_out` and `gtg_shapley` (default tolerances; above `--gtg-full-up-to`
contributors `max_permutations` is capped at `--gtg-cap` and the table says so), each with
torch threads 1 and 2. "per utility" is the wall time inside U per call; the rest of a round is
aggregation and bookkeeping. The anchor is one evaluation of the merged aggregate, what the round
itself already spends on its quality gate.

    python bench/scoring.py                          # 10 and 100 contributions, threads 1 and 2
    python bench/scoring.py --contributions 10 --threads 1 --methods individual,leave_one_out
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from zoo_gym.aggregation import aggregate
from zoo_gym.coordinator.config import CoordinatorConfig, load_config
from zoo_gym.coordinator.evaluation import Evaluator
from zoo_gym.coordinator.registry import ModelRegistry
from zoo_gym.coordinator.rounds import lora_spec, round_seed, update_layout
from zoo_gym.coordinator.setup import init_home
from zoo_gym.core.delta import Layout, flatten, numel, unflatten
from zoo_gym.core.identity import Identity
from zoo_gym.core.lora import LoraSpec, merge_ffa
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


def trained_updates(r: Round, clients: int = 2) -> list[Tensor]:
    """`clients` real FFA-LoRA updates `(d,)` from the client's trainer on disjoint shards."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from zoo_gym.client.trainers.sft import FfaLoraTrainer
    from zoo_gym.core.chat import to_conversation
    from zoo_gym.core.synthetic import make_examples, shard

    model = AutoModelForCausalLM.from_pretrained(r.model_dir, dtype=torch.float32)
    trainer = FfaLoraTrainer(model, AutoTokenizer.from_pretrained(r.model_dir), spec=r.spec)
    t = r.config.training
    updates = []
    for records in shard(make_examples(clients * EXAMPLES_PER_CLIENT, seed=1), clients):
        result = trainer.train_round(
            [to_conversation(x) for x in records],
            seed=r.seed,
            steps=t.steps,
            lr=t.learning_rate,
            batch_size=t.batch_size,
            max_length=t.max_length,
        )
        updates.append(flatten(result.update, r.layout))
    return updates


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
    """U(v) = -validation loss of the base merged with v, timing every call."""

    r: Round
    seconds: float = 0.0
    calls: int = 0

    def __call__(self, vector: Tensor) -> float:
        start = time.perf_counter()
        candidate = {k: v.clone() for k, v in self.r.state.items()}
        merge_ffa(
            candidate, unflatten(vector.float(), self.r.layout), spec=self.r.spec, seed=self.r.seed
        )
        value = -self.r.evaluator.loss(candidate)
        self.seconds += time.perf_counter() - start
        self.calls += 1
        return value


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
    quality = score_contributions(
        updates,
        utility=utility,
        method=method,
        aggregate_fn=None if method == "individual" else aggregate_fn(rule),
        **params,
    )
    seconds = time.perf_counter() - start
    shown = ", ".join(f"{k}={v}" for k, v in params.items()) or "defaults"
    return Row(
        torch.get_num_threads(),
        updates.shape[0],
        method,
        "-" if method == "individual" else rule,
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
        "| utility evals | aggregations | permutations | s / utility eval | x round's own eval |",
        "|---:|---:|---|---|---|---:|---:|---:|---:|---:|---:|",
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
            f"{row.seconds:,.1f} | {q.utility_calls} | {q.aggregations} | {perms} | "
            f"{row.utility_seconds:.3f} | {row.seconds / anchors[(row.threads, row.n)]:,.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contributions", default="10,100", help="n per round, comma separated")
    parser.add_argument("--threads", default="1,2", help="torch threads, comma separated")
    parser.add_argument("--methods", default="individual,leave_one_out,gtg_shapley")
    parser.add_argument("--rules", default="fedavg,median", help="aggregation rules")
    parser.add_argument(
        "--gtg-full-up-to",
        type=int,
        default=20,
        help="run gtg_shapley with its default max_permutations up to this many contributions",
    )
    parser.add_argument("--gtg-cap", type=int, default=10, help="max_permutations above that")
    args = parser.parse_args(argv)
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
                    for rule in rules if method != "individual" else rules[:1]:
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
