"""Benchmark: optimisation steps per second of GRPO / GSPO against SFT on the tiny model (CPU).

The model is the tiny demo base (`zoo_gym.core.tiny.create_tiny_base`, Qwen2, hidden 64, two
layers, 150 pretraining steps), wrapped by the contributor's trainer (`FfaLoraTrainer`, FFA-LoRA
rank 8 on q/k/v/o/gate/up/down), float32 on the CPU, torch threads as given. Data: 200 synthetic
addition records.

- SFT (the anchor): `FfaLoraTrainer.train_round`, batch 8 conversations, max length 96.
- GRPO / GSPO: `zoo_gym.client.trainers.grpo.train_grpo`, batch 8 prompts x `--generations`
  completions, `--new-tokens` new tokens, built-in rewards exact_answer + format + length,
  kl_beta 0.04 (so one extra forward pass under the reference). A step = sampling + rewards +
  3 forward passes (old, reference, current) + one backward + AdamW.

Each row times `--steps` steps after one warm-up round of 2 steps; "ratio" is SFT steps/s over
the row's steps/s (how many SFT steps one GRPO step costs).

    python bench/training.py                       # threads 1, 8 generations of 8 tokens
    python bench/training.py --threads 2 --steps 20 --generations 4
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from zoo_gym.client.trainers.grpo import prompts_from_conversations, train_grpo
from zoo_gym.client.trainers.reward_functions import load_reward_functions
from zoo_gym.client.trainers.sft import FfaLoraTrainer
from zoo_gym.core import synthetic
from zoo_gym.core.chat import to_conversation
from zoo_gym.core.lora import LoraSpec
from zoo_gym.core.tiny import create_tiny_base


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        create_tiny_base(base, seed=0)
        tokenizer = AutoTokenizer.from_pretrained(base)
        trainer = FfaLoraTrainer(
            AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
            tokenizer,
            spec=LoraSpec(rank=8, alpha=16.0),
        )
        conversations = [to_conversation(r) for r in synthetic.make_examples(200, seed=1)]
        prompts = prompts_from_conversations(conversations)
        rewards = load_reward_functions(["exact_answer", "format", "length"], [])

        def sft(steps: int) -> float:
            start = time.perf_counter()
            trainer.train_round(
                conversations, seed=1, steps=steps, lr=5e-3, batch_size=args.batch, max_length=96
            )
            return time.perf_counter() - start

        def rl(objective: str, steps: int) -> float:
            start = time.perf_counter()
            train_grpo(
                trainer, prompts, objective=objective, seed=1, steps=steps, lr=5e-3,
                batch_size=args.batch, num_generations=args.generations,
                max_new_tokens=args.new_tokens, temperature=1.0, clip_epsilon=0.2, kl_beta=0.04,
                rewards=rewards, max_length=96,
            )  # fmt: skip
            return time.perf_counter() - start

        runs = {
            "sft": lambda n: sft(n),
            "grpo": lambda n: rl("grpo", n),
            "gspo": lambda n: rl("gspo", n),
        }
        rates: dict[str, float] = {}
        for name, run in runs.items():
            run(2)  # warm-up
            rates[name] = args.steps / run(args.steps)

    print(
        f"tiny Qwen2 (hidden 64, 2 layers), FFA-LoRA r8, CPU float32, {args.threads} thread(s), "
        f"{args.steps} steps; RL: {args.batch} prompts x {args.generations} completions x "
        f"{args.new_tokens} new tokens; SFT: batch {args.batch}"
    )
    print(f"| {'method':<6} | {'steps/s':>8} | {'s/step':>7} | {'SFT steps per step':>18} |")
    print(f"|{'-' * 8}|{'-' * 10}|{'-' * 9}|{'-' * 20}|")
    for name, rate in rates.items():
        print(f"| {name:<6} | {rate:8.2f} | {1 / rate:7.3f} | {rates['sft'] / rate:18.2f} |")


if __name__ == "__main__":
    main()
