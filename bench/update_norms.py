"""How large honest FFA-LoRA updates are, against intake's default `max_update_norm`.

Trains one round (the default task: 30 AdamW steps at learning rate 5e-3, batch 8, rank 8 on
every attention and MLP projection) with the client's own trainer on models of growing width,
and prints the update's L2 norm, its RMS per value and that RMS times the square root of a 7B
model's update size (Llama-2-7B shapes: 32 layers, hidden 4096, MLP 11008: d = 10.9M). AdamW
moves each value by about the learning rate per step whatever the width, so the RMS carries over.

    python bench/update_norms.py [--widths 64 256 512]
"""

from __future__ import annotations

import argparse
import math

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from zoo_gym.client.trainers.adapters import make_trainer
from zoo_gym.coordinator.config import CoordinatorConfig
from zoo_gym.core import synthetic
from zoo_gym.core.chat import to_conversation
from zoo_gym.core.lora import LoraSpec
from zoo_gym.core.tiny import train_tiny_tokenizer

D_7B = 32 * 8 * (3 * 4096 + 4096 + 2 * 11008 + 4096)  # B matrices (out, 8) of q k v o gate up down


def round_update_norm(
    width: int, tokenizer: object, conversations: list[object]
) -> tuple[float, int]:
    config = LlamaConfig(
        vocab_size=len(tokenizer),  # type: ignore[arg-type]
        hidden_size=width,
        intermediate_size=int(width * 2.6875),
        num_hidden_layers=2,
        num_attention_heads=max(width // 64, 1),
        num_key_value_heads=max(width // 64, 1),
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        config, attn_implementation="sdpa", dtype=torch.float32
    )
    trainer = make_trainer(model, tokenizer, adapter="ffa_lora", spec=LoraSpec())  # type: ignore[arg-type]
    t = CoordinatorConfig().training
    result = trainer.train_round(
        conversations,  # type: ignore[arg-type]
        seed=1,
        steps=t.steps,
        lr=t.learning_rate,
        batch_size=t.batch_size,
        max_length=t.max_length,
    )
    values = torch.cat([v.reshape(-1) for v in result.update.values()]).double()
    return float(values.norm()), values.numel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", type=int, nargs="+", default=[64, 256, 512])
    args = parser.parse_args()
    torch.set_num_threads(2)
    records = synthetic.make_examples(400, seed=1)
    tokenizer = train_tiny_tokenizer([r["instruction"] + "\n" + r["output"] for r in records])
    conversations = [to_conversation(r) for r in records]
    bound = CoordinatorConfig().max_update_norm
    print(f"{'width':>6} {'d':>9} {'||update||':>11} {'rms':>9} {'at 7B d':>9} {'bound / 7B':>10}")
    for width in args.widths:
        norm, d = round_update_norm(width, tokenizer, conversations)
        rms = norm / math.sqrt(d)
        projected = rms * math.sqrt(D_7B)
        print(
            f"{width:>6} {d:>9} {norm:>11.3f} {rms:>9.5f} {projected:>9.1f} {bound / projected:>10.1f}"
        )


if __name__ == "__main__":
    main()
