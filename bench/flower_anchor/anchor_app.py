"""Flower anchor for bench/round_overhead.py: the zoo-gym round, done Flower's way.

ServerApp: `flwr.serverapp.strategy.FedAvg` over an ArrayRecord of the FFA-LoRA
B matrices (zeros at the start of each round, as FFA-LoRA trains them), with
central evaluation (`evaluate_fn`) doing what zoo-gym's publish step does:
merge the averaged B into the base (`merge_ffa`) and compute the validation loss.
ClientApp: loads the same tiny model and trains it with zoo-gym's
`FfaLoraTrainer` for the same steps on its shard. Timestamps go to `out-file`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _mark(path: str, event: str, **extra: object) -> None:
    with open(path, "a") as fh:
        fh.write(json.dumps({"event": event, "t": time.time(), **extra}) + "\n")


def _spec(cfg: dict) -> object:
    from zoo_gym.core.lora import LoraSpec

    return LoraSpec(
        rank=int(cfg["lora-rank"]), alpha=float(cfg["lora-alpha"]), target_modules=TARGETS
    )


server = ServerApp()


class TimedFedAvg(FedAvg):
    """FedAvg that stamps the start of each round's training."""

    out = ""

    def configure_train(self, server_round, arrays, config, grid):  # type: ignore[no-untyped-def]
        _mark(self.out, "round_start", round=server_round)
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round, replies):  # type: ignore[no-untyped-def]
        replies = list(replies)
        _mark(self.out, "replies_in", round=server_round)
        result = super().aggregate_train(server_round, replies)
        _mark(self.out, "aggregated", round=server_round)
        return result


@server.main()
def main(grid: Grid, context: Context) -> None:
    torch.set_num_threads(1)
    cfg = context.run_config
    out = str(cfg["out-file"])
    _mark(out, "serverapp_start")
    from zoo_gym.coordinator.evaluation import Evaluator
    from zoo_gym.coordinator.rounds import round_seed, update_layout
    from zoo_gym.core.lora import merge_ffa
    from zoo_gym.core.weights import load_weights

    model_dir = Path(str(cfg["model-dir"]))
    spec = _spec(cfg)
    state = load_weights(model_dir)
    layout = update_layout(state, spec)  # type: ignore[arg-type]
    zeros = {s.name: torch.zeros(s.shape) for s in layout}
    evaluator = Evaluator(
        model_dir, Path(str(cfg["validation"])), max_length=int(cfg["max-length"])
    )
    seed = round_seed(int(cfg["seed"]), 1)
    nodes = int(cfg["min-nodes"])

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        if server_round == 0:
            return MetricRecord({"loss": evaluator.loss(state)})
        candidate = {k: v.clone() for k, v in state.items()}
        merge_ffa(candidate, arrays.to_torch_state_dict(), spec=spec, seed=seed)  # type: ignore[arg-type]
        loss = evaluator.loss(candidate)
        _mark(out, "round_end", round=server_round, loss=loss)
        return MetricRecord({"loss": loss})

    strategy = TimedFedAvg(
        fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=nodes, min_available_nodes=nodes
    )
    strategy.out = out
    _mark(out, "strategy_start")
    started = time.perf_counter()
    # every round restarts B from zero (FFA-LoRA), so each round gets the zeros
    strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(torch_state_dict=zeros),
        num_rounds=int(cfg["num-rounds"]),
        train_config=ConfigRecord({"seed": seed}),
        evaluate_fn=evaluate,
    )
    _mark(out, "strategy_end", seconds=time.perf_counter() - started)


client = ClientApp()


@client.train()
def train(msg: Message, context: Context) -> Message:
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from zoo_gym.client.trainers.sft import FfaLoraTrainer
    from zoo_gym.core.chat import to_conversation

    started = time.perf_counter()
    cfg = context.run_config
    pid = int(context.node_config["partition-id"])
    model_dir = Path(str(cfg["model-dir"]))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    trainer = FfaLoraTrainer(model, tokenizer, spec=_spec(cfg), device="cpu")  # type: ignore[arg-type]
    lines = (Path(str(cfg["data-dir"])) / f"shard-{pid}.jsonl").read_text().splitlines()
    conversations = [to_conversation(json.loads(line)) for line in lines if line.strip()]
    loaded = time.perf_counter()
    result = trainer.train_round(
        conversations,
        seed=int(msg.content["config"]["seed"]),
        steps=int(cfg["steps"]),
        lr=float(cfg["lr"]),
        batch_size=int(cfg["batch-size"]),
        max_length=int(cfg["max-length"]),
    )
    _mark(
        str(cfg["out-file"]),
        "client_train",
        partition=pid,
        load_seconds=loaded - started,
        train_seconds=time.perf_counter() - loaded,
    )
    arrays = ArrayRecord(torch_state_dict={k: v.contiguous() for k, v in result.update.items()})
    metrics = MetricRecord(
        {
            "num-examples": result.num_examples,
            "train_loss": result.mean_loss,
            "load_seconds": loaded - started,
            "train_seconds": time.perf_counter() - loaded,
        }
    )
    return Message(RecordDict({"arrays": arrays, "metrics": metrics}), reply_to=msg)
