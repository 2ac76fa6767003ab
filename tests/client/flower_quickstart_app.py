"""A contributor's own ClientApp, written the way Flower's quickstarts write one: load the model,
a few optimiser steps on local data, reply with the new weights and the number of examples.

For `full` rounds it loads the received state dict into the model, as quickstart-pytorch does;
for LoRA rounds it builds the peft model from the round's config and loads the received adapter
state dict, as Flower's LLM fine-tuning examples do. `Context.node_config["fault"]` spoils the
reply on purpose (the tests of bad replies), and every reply is kept in `REPLIES` (and, with
`node_config["replies"]`, in a file in that directory) for the tests to compare with what the
coordinator received.
"""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from safetensors.torch import save_file
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, AutoTokenizer

LOCAL_DATA = [f"{a} + {b} = {a + b}" for a in range(4) for b in range(3)]  # 12 examples

REPLIES: list[dict[str, torch.Tensor]] = []  # the arrays of every reply, in order

# Flower ClientApp
app = ClientApp()


def load_data(tokenizer: AutoTokenizer, batch_size: int) -> DataLoader[torch.Tensor]:
    """The local examples as padded token ids."""
    ids = tokenizer(LOCAL_DATA, padding="max_length", max_length=16, return_tensors="pt")
    return DataLoader(ids["input_ids"], batch_size=batch_size, shuffle=False)


def train_fn(
    model: torch.nn.Module, trainloader: DataLoader[torch.Tensor], steps: int, lr: float
) -> float:
    """`steps` AdamW steps of next-token loss over the batches in turn; the mean loss."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr)
    model.train()
    losses = []
    batches = iter(())
    for _ in range(steps):
        batch = next(batches, None)
        if batch is None:
            batches = iter(trainloader)
            batch = next(batches)
        optimizer.zero_grad()
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return sum(losses) / len(losses)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Train the model on local data."""
    config = msg.content["config"]

    # Load the model and initialize it with the received weights
    model = AutoModelForCausalLM.from_pretrained(config["model_dir"])
    received = msg.content["arrays"].to_torch_state_dict()
    if config["adapter"] == "full":
        model.load_state_dict(received)
    else:
        lora = LoraConfig(
            r=config["lora_rank"],
            lora_alpha=config["lora_alpha"],
            target_modules=list(config["target_modules"]),
        )
        model = get_peft_model(model, lora)
        set_peft_model_state_dict(model, received)
        if config["adapter"] == "ffa_lora":  # only B trains
            for name, param in model.named_parameters():
                if "lora_A" in name:
                    param.requires_grad_(False)

    # Load the data
    tokenizer = AutoTokenizer.from_pretrained(config["model_dir"])
    trainloader = load_data(tokenizer, batch_size=4)

    # Call the training function
    train_loss = train_fn(model, trainloader, config["steps"], config["learning_rate"])

    # Construct and return reply Message
    state = model.state_dict() if config["adapter"] == "full" else get_peft_model_state_dict(model)
    state = {k: v.detach().clone() for k, v in state.items()}
    metrics = {"train_loss": train_loss, "num-examples": len(trainloader.dataset)}
    spoil(state, metrics, str(context.node_config.get("fault", "")))
    REPLIES.append(state)
    if "replies" in context.node_config:  # for a test that runs `join` in another process
        save_file(state, f"{context.node_config['replies']}/round-{config['round']}.safetensors")
    content = RecordDict({"arrays": ArrayRecord(state), "metrics": MetricRecord(metrics)})
    return Message(content=content, reply_to=msg)


def spoil(state: dict[str, torch.Tensor], metrics: dict[str, float | int], fault: str) -> None:
    """Make the reply wrong in the way `fault` names ("" leaves it right)."""
    first = sorted(state)[0]
    if fault == "missing-key":
        del state[first]
    elif fault == "wrong-shape":
        state[first] = state[first][:-1]
    elif fault == "non-finite":
        state[first][0] = float("nan")
    elif fault == "no-num-examples":
        del metrics["num-examples"]
    elif fault == "trained-a":
        name = next(k for k in sorted(state) if "lora_A" in k)
        state[name] = state[name] + 0.01
