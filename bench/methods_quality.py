"""Benchmark: model quality after R federated rounds per training method, and SFT speed per adapter.

Quality. The tiny base (`zoo_gym.core.tiny.create_tiny_base`, seed 0) and the synthetic task;
K contributors with disjoint shards of `--examples` records each; every round each contributor
starts from the current base, trains `--steps` AdamW steps (batch 8, max length 96, LoRA rank 8,
alpha 16 on q/k/v/o/gate/up/down), and the round's updates are averaged (FedAvg, uncompressed)
and merged into the base. Validation loss (mean completion NLL on 200 held-out records) after
each round, for:

- ``ffa_lora``: FFA-LoRA, A frozen from the round seed, mean of the B's; exact:
  ``s·mean(B_i)·A = mean(s·B_i·A)``.
- ``lora_factors``: plain LoRA (A and B train) with A's and B's averaged *separately*, merged as
  ``s·mean(B_i)·mean(A_i)`` -- the known inexact aggregation, a baseline only (the coordinator has
  no such mode).
- ``lora_dense``: plain LoRA sending the dense delta ``s·B_i·A_i``, averaged exactly.

The anchor is ``ffa_lora``; the ratio printed is each method's final loss over the anchor's.

Speed. `train_round` steps per second and tokens per second for every adapter (one round of
`--speed-steps` steps after a warm-up round), torch threads as given.

    python bench/methods_quality.py                   # 4 contributors, 5 rounds
    python bench/methods_quality.py --rounds 3 --clients 2 --threads 2
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from zoo_gym.client.trainers.adapters import LoraTrainer, make_trainer
from zoo_gym.client.trainers.sft import FfaLoraTrainer, Trainer, _lora
from zoo_gym.core import synthetic
from zoo_gym.core.chat import Conversation, to_conversation
from zoo_gym.core.delta import Delta
from zoo_gym.core.evaluate import validation_loss
from zoo_gym.core.lora import LoraSpec, merge_dense, merge_ffa
from zoo_gym.core.protocol import ADAPTERS
from zoo_gym.core.tiny import create_tiny_base
from zoo_gym.core.weights import load_weights

SPEC = LoraSpec(rank=8, alpha=16.0)
State = dict[str, torch.Tensor]
# (trainer, state, client data, round seed) -> merges the round's aggregate into state
RoundFn = Callable[[Trainer, State, list[list[Conversation]], int], None]


def _train(
    trainer: Trainer, state: State, data: list[Conversation], seed: int, args: argparse.Namespace
) -> Delta:
    trainer.load_base(state)
    return trainer.train_round(
        data, seed=seed, steps=args.steps, lr=args.lr, batch_size=8, max_length=96
    ).update


def _mean(updates: list[Delta]) -> Delta:
    return {k: torch.stack([u[k] for u in updates]).mean(0) for k in updates[0]}


def run_quality(
    method: str,
    base_dir: Path,
    tokenizer: PreTrainedTokenizerBase,
    clients: list[list[Conversation]],
    valid: list[synthetic.Record],
    args: argparse.Namespace,
) -> list[float]:
    """Validation loss before round 1 and after each of `args.rounds` rounds."""
    adapter = "ffa_lora" if method == "ffa_lora" else "lora"
    trainer = make_trainer(base_dir, tokenizer, adapter=adapter, spec=SPEC)
    state = load_weights(base_dir)
    evaluator = AutoModelForCausalLM.from_pretrained(base_dir)
    losses = [validation_loss(evaluator, tokenizer, valid)]
    for r in range(1, args.rounds + 1):
        seed = 1000 + r
        if method == "ffa_lora":
            assert isinstance(trainer, FfaLoraTrainer)
            updates = [_train(trainer, state, data, seed, args) for data in clients]
            merge_ffa(state, _mean(updates), spec=SPEC, seed=seed)
        elif method == "lora_dense":
            updates = [_train(trainer, state, data, seed, args) for data in clients]
            merge_dense(state, _mean(updates))
        else:  # lora_factors: average A's and B's separately (inexact)
            assert isinstance(trainer, LoraTrainer)
            factors: list[Delta] = []
            for data in clients:
                _train(trainer, state, data, seed, args)
                factors.append(
                    {
                        f"{name}|{which}": _lora(layer, which).detach().float().clone()
                        for name, layer in trainer.layers.items()
                        for which in ("lora_A", "lora_B")
                    }
                )
            mean = _mean(factors)
            delta = {
                f"{name}.weight": SPEC.scaling * mean[f"{name}|lora_B"] @ mean[f"{name}|lora_A"]
                for name in trainer.layers
            }
            merge_dense(state, delta)
        evaluator.load_state_dict(state)
        losses.append(validation_loss(evaluator, tokenizer, valid))
        print(f"  {method} round {r}: validation loss {losses[-1]:.4f}", flush=True)
    return losses


def run_speed(
    adapter: str,
    base_dir: Path,
    tokenizer: PreTrainedTokenizerBase,
    data: list[Conversation],
    args: argparse.Namespace,
    *,
    checkpointing: bool = False,
) -> tuple[float, float]:
    """(steps/s, tokens/s) of one `train_round` after a warm-up round."""
    trainer = make_trainer(
        base_dir, tokenizer, adapter=adapter, spec=SPEC, gradient_checkpointing=checkpointing
    )
    lr = 2e-3 if adapter == "full" else args.lr
    trainer.train_round(data, seed=1, steps=3, lr=lr, batch_size=8, max_length=96)
    start = time.perf_counter()
    result = trainer.train_round(
        data, seed=2, steps=args.speed_steps, lr=lr, batch_size=8, max_length=96
    )
    seconds = time.perf_counter() - start
    return args.speed_steps / seconds, result.tokens / seconds


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--examples", type=int, default=60, help="records per contributor")
    parser.add_argument("--steps", type=int, default=20, help="local steps per round")
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--speed-steps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        base_dir = Path(tmp) / "tiny"
        create_tiny_base(base_dir, seed=0)
        tokenizer = AutoTokenizer.from_pretrained(base_dir)
        records = synthetic.make_examples(args.clients * args.examples, seed=11)
        clients = [
            [to_conversation(r) for r in part] for part in synthetic.shard(records, args.clients)
        ]
        valid = synthetic.make_examples(200, seed=999)

        methods = ("ffa_lora", "lora_factors", "lora_dense")
        curves = {m: run_quality(m, base_dir, tokenizer, clients, valid, args) for m in methods}
        print(
            f"\nValidation loss after each round ({args.clients} contributors, {args.steps} steps, "
            f"lr {args.lr}, FedAvg, uncompressed)\n"
        )
        print(
            "| method | "
            + " | ".join(f"r{r}" for r in range(args.rounds + 1))
            + " | final / ffa_lora |"
        )
        print("|---|" + "---|" * (args.rounds + 2))
        anchor = curves["ffa_lora"][-1]
        for m in methods:
            row = " | ".join(f"{x:.4f}" for x in curves[m])
            print(f"| {m} | {row} | {curves[m][-1] / anchor:.3f} |")

        print(
            f"\nSFT speed, {args.speed_steps} steps of batch 8, max length 96, {args.threads} thread(s)\n"
        )
        print("| adapter | steps/s | tokens/s | steps/s / ffa_lora |")
        print("|---|---|---|---|")
        rows = [(a, False) for a in ADAPTERS] + [("lora", True)]
        speeds = {
            (a, c): run_speed(a, base_dir, tokenizer, clients[0], args, checkpointing=c)
            for a, c in rows
        }
        base_speed = speeds[("ffa_lora", False)][0]
        for (a, c), (steps_s, tokens_s) in speeds.items():
            name = f"{a} + checkpointing" if c else a
            print(f"| {name} | {steps_s:.2f} | {tokens_s:.0f} | {steps_s / base_speed:.2f} |")


if __name__ == "__main__":
    main()
