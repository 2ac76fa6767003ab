"""A contributor's own Flower ClientApp in zoo-gym rounds (`gym-client join --app MODULE:ATTR`).

The app gets a train Message as Flower apps do and replies as Flower apps do:

- in: an ArrayRecord under ``"arrays"``, the round's starting values of the tensors the round's
  adapter trains (float32, by the names the model or peft gives them), and a ConfigRecord under
  ``"config"``: ``model_dir`` (the verified base, loadable with
  ``AutoModelForCausalLM.from_pretrained``), ``round``, ``steps``, ``learning_rate`` and the rest
  of `train_config`;
- out: an ArrayRecord under ``"arrays"`` with the same keys and shapes (the new values) and a
  MetricRecord with ``"num-examples"`` (and, if the app has one, ``"train_loss"``).

What the arrays are, by the round's adapter (`round_tensors`):

- ``full``: every tensor of the base's ``model.state_dict()`` (a tied weight under each of its
  names); the update is the new value minus the base of every floating weight, as stored once.
- ``lora``: peft's adapter tensors as ``get_peft_model_state_dict`` names them
  (``"base_model.model.<module>.lora_A.weight"`` `(r, in)` and ``".lora_B.weight"`` `(out, r)`),
  A drawn from the round's seed (`frozen_a`, the same on every client), B zero, so every client
  starts at the base. The update is ``(alpha / r) · B·A`` per target weight, as the built-in
  LoRA trainer sends it.
- ``ffa_lora``: the same tensors; A must come back unchanged (only B trains) and the update is B.

``dora`` and ``qlora`` rounds are refused. zoo-gym turns the reply into the round's update and
hands it to `ClientRuntime.reply`: clipping, update noise, compression with error feedback and
the signature are the same as for the built-in trainers. DP-SGD clips and noises each example's
gradient inside training, which here is the app's: a round asking for it is refused
(`plan_app_round`) before the app runs. Anything wrong with the reply is one line
(`UserAppError`), and nothing is submitted.
"""

from __future__ import annotations

import copy
import importlib
import math
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from torch import Tensor

from zoo_gym.client.errors import RoundRefusal
from zoo_gym.client.privacy import PrivacyPlan, PrivacyRefusal, plan_round
from zoo_gym.client.runtime import ClientRuntime, RoundEvent, task_spec
from zoo_gym.client.trainers.sft import RoundResult
from zoo_gym.core.delta import Delta
from zoo_gym.core.lora import (
    LoraSpec,
    for_base,
    frozen_a,
    linear_layers,
    stored,
    target_weights,
    update_key,
)
from zoo_gym.core.phases import phase
from zoo_gym.core.protocol import TaskConfig
from zoo_gym.core.weights import load_weights

ARRAYS = "arrays"
CONFIG = "config"
NUM_EXAMPLES = "num-examples"
APP_ADAPTERS = ("full", "lora", "ffa_lora")
"""The adapters a contributor's own ClientApp can train; zoo-gym refuses rounds of the others."""


class UserAppError(ValueError):
    """The contributor's ClientApp cannot be loaded, or its reply is not an update (one line)."""


def load_client_app(path: str, *, app_dir: Path | None = None) -> ClientApp:
    """The `flwr.clientapp.ClientApp` at ``"package.module:attribute"``, imported with `app_dir`
    (`join` passes the working directory, as uvicorn does) searched first."""
    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute:
        raise UserAppError(f"app {path!r} is not MODULE:ATTRIBUTE; name it like package.module:app")
    if app_dir is not None and str(app_dir) not in sys.path:
        sys.path.insert(0, str(app_dir))
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise UserAppError(
            f"app {path}: no module named {exc.name!r}; install the app's package or put its "
            "directory on PYTHONPATH"
        ) from None
    app = getattr(module, attribute, None)
    if app is None:
        raise UserAppError(f"app {path}: module {module_name} has no attribute {attribute!r}")
    if not isinstance(app, ClientApp):
        raise UserAppError(
            f"app {path}: {attribute} is a {type(app).__name__}, not a flwr.clientapp.ClientApp"
        )
    return app


def peft_key(module: str, factor: str) -> str:
    """peft's name of `module`'s LoRA `factor` ("lora_A" / "lora_B") in its adapter state dict."""
    return f"base_model.model.{module}.{factor}.weight"


@dataclass(frozen=True)
class RoundTensors:
    """What a round's adapter trains, as the app gets it (`arrays`, float32 on the CPU), and
    what the update is made of.

    `stored_as` maps each name sent to the name the base stores its value under (a tied
    weight's second name to its first); `in_features` is target module -> input features.
    """

    adapter: str
    spec: LoraSpec
    arrays: dict[str, Tensor]
    stored_as: dict[str, str]
    in_features: dict[str, int]

    def update(self, new: Mapping[str, Tensor], round: int) -> Delta:
        """The round's update from the app's new values (keys and shapes already checked)."""
        if self.adapter == "full":
            return {
                name: new[name].float() - self.arrays[name]
                for name, kept in sorted(self.stored_as.items())
                if name == kept and torch.is_floating_point(self.arrays[name])
            }
        update: Delta = {}
        for module in sorted(self.in_features):
            a, b = new[peft_key(module, "lora_A")], new[peft_key(module, "lora_B")].float()
            if self.adapter == "ffa_lora":  # A as sent, in the precision the app keeps it in
                if not torch.equal(a, self.arrays[peft_key(module, "lora_A")].to(a.dtype)):
                    raise UserAppError(
                        f"round {round}: your ClientApp changed {peft_key(module, 'lora_A')}; an "
                        "ffa_lora round trains only the B matrices: freeze every lora_A "
                        "(requires_grad_(False)); nothing was submitted"
                    )
                update[update_key(module)] = b
            else:  # B started at zero: the round moved the weight by s·B·A
                weight = self.spec.scaling * (b @ a.float())  # (out, in)
                update[module + ".weight"] = stored(weight, module, self.spec)
        return update


def check_adapter(task: TaskConfig) -> None:
    """Refuse (a `RoundRefusal`: `join` stops) a round whose adapter an app cannot train here."""
    if task.adapter not in APP_ADAPTERS:
        raise RoundRefusal(
            f"round {task.round} uses the {task.adapter} adapter, which zoo-gym does not hand to "
            f"a ClientApp of your own (it hands {', '.join(APP_ADAPTERS)}); join without --app to "
            "take this round"
        )


def round_tensors(directory: Path, task: TaskConfig) -> RoundTensors:
    """What the app trains in `task`'s round on the base in `directory` (see the module doc).

    Shapes come from the model built on the meta device; only `full` reads the weights.
    """
    skeleton = meta_model(directory)
    spec = for_base(task_spec(task), linear_layers(skeleton), adapter=task.adapter)
    shapes = target_weights(skeleton, spec)  # module -> (out, in)
    in_features = {module: in_ for module, (_out, in_) in shapes.items()}
    if task.adapter == "full":
        weights = load_weights(directory)
        stored_as = state_dict_names(skeleton, weights)
        arrays = {name: _float32(weights[kept]) for name, kept in stored_as.items()}
        return RoundTensors(task.adapter, spec, arrays, stored_as, in_features)
    arrays = {}
    for module, (out, in_) in sorted(shapes.items()):
        arrays[peft_key(module, "lora_A")] = frozen_a(task.a_seed, module, in_, spec.rank)
        arrays[peft_key(module, "lora_B")] = torch.zeros(out, spec.rank)
    return RoundTensors(task.adapter, spec, arrays, {k: k for k in arrays}, in_features)


def _float32(tensor: Tensor) -> Tensor:
    return tensor.float() if torch.is_floating_point(tensor) else tensor


def meta_model(directory: Path) -> torch.nn.Module:
    """The causal LM in `directory`, built on the meta device (no weights, nothing allocated)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(directory)  # type: ignore[no-untyped-call]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    assert isinstance(model, torch.nn.Module)
    return model


def state_dict_names(model: torch.nn.Module, weights: Mapping[str, Tensor]) -> dict[str, str]:
    """Every name in `model`'s ``state_dict()`` -> the name its value is stored under in
    `weights`: itself, or for a tied weight the stored name of the tensor it shares."""
    state = model.state_dict(keep_vars=True)
    first = {id(tensor): name for name, tensor in state.items() if name in weights}
    names = {}
    for name, tensor in state.items():
        kept = name if name in weights else first.get(id(tensor))
        if kept is None:
            raise ValueError(f"the base's weight files hold no {name}, which the model has")
        names[name] = kept
    return names


def train_config(task: TaskConfig, directory: Path) -> ConfigRecord:
    """The ConfigRecord the app gets under "config": where the base is and how to train."""
    return ConfigRecord(
        {
            "model_dir": str(directory),
            "base_version": task.base_version,
            "round": task.round,
            "seed": task.seed,
            "method": task.method,
            "adapter": task.adapter,
            "steps": task.steps,
            "learning_rate": task.learning_rate,
            "batch_size": task.batch_size,
            "max_length": task.max_length,
            "lora_rank": task.lora_rank,
            "lora_alpha": task.lora_alpha,
            "target_modules": list(task.target_modules),
        }
    )


def train_message(
    message: Message, task: TaskConfig, tensors: RoundTensors, directory: Path
) -> Message:
    """The Flower train Message the app gets: zoo-gym's task `message` (its metadata: to this
    node, of type "train", in the round's group) with the arrays and config as its content."""
    request = copy.copy(message)  # a new Message would take its ids from Flower's runners
    request.content = RecordDict(
        {ARRAYS: ArrayRecord(tensors.arrays), CONFIG: train_config(task, directory)}
    )
    return request


def reply_result(reply: Message, tensors: RoundTensors, round: int, seconds: float) -> RoundResult:
    """The round's result from the app's `reply`; raises `UserAppError` (one line) when the reply
    is not one."""
    where = f"round {round}: your ClientApp's reply"
    if reply.has_error():
        raise UserAppError(
            f"{where} is an error ({reply.error.code}: {reply.error.reason}); nothing was submitted"
        )
    arrays = reply.content.array_records.get(ARRAYS)
    if arrays is None:
        raise UserAppError(
            f'{where} has no ArrayRecord under "arrays"; reply with the trained tensors as '
            'RecordDict({"arrays": ArrayRecord(...), "metrics": MetricRecord(...)})'
        )
    new = check_arrays(arrays.to_torch_state_dict(), tensors.arrays, where)
    num_examples = reported_examples(reply, where)
    losses = [r["train_loss"] for r in reply.content.metric_records.values() if "train_loss" in r]
    loss = losses[0] if losses else math.nan
    return RoundResult(
        update=tensors.update(new, round),
        num_examples=num_examples,
        mean_loss=float(loss) if isinstance(loss, int | float) else math.nan,
        tokens=0,
        seconds=seconds,
    )


def check_arrays(
    new: Mapping[str, Tensor], sent: Mapping[str, Tensor], where: str
) -> dict[str, Tensor]:
    """`new` when it holds exactly the names of `sent`, each of the same shape, all finite."""
    missing = sorted(set(sent) - set(new))
    if missing:
        raise UserAppError(
            f"{where} lacks {len(missing)} of the {len(sent)} arrays it was sent, e.g. {missing[0]!r}; "
            "return every tensor of msg.content['arrays'], trained; nothing was submitted"
        )
    extra = sorted(set(new) - set(sent))
    if extra:
        raise UserAppError(
            f"{where} has {len(extra)} arrays it was not sent, e.g. {extra[0]!r}; return the keys "
            "of msg.content['arrays'] only; nothing was submitted"
        )
    for name, tensor in sorted(new.items()):
        if tensor.shape != sent[name].shape:
            raise UserAppError(
                f"{where} has {name!r} of shape {tuple(tensor.shape)}; it was sent as "
                f"{tuple(sent[name].shape)}: keep every shape; nothing was submitted"
            )
        if not bool(torch.isfinite(tensor).all()):
            raise UserAppError(
                f"{where} has NaN or infinite values in {name!r}; nothing was submitted"
            )
    return dict(new)


def reported_examples(reply: Message, where: str) -> int:
    """The reply's "num-examples" (in any of its MetricRecords), a positive whole number."""
    for record in reply.content.metric_records.values():
        if NUM_EXAMPLES in record:
            value = record[NUM_EXAMPLES]
            if isinstance(value, int | float) and value >= 1 and float(value).is_integer():
                return int(value)
            raise UserAppError(
                f'{where} says "num-examples" is {value!r}; it must be the number of examples '
                "trained on (1 or more); nothing was submitted"
            )
    raise UserAppError(
        f'{where} has no MetricRecord with "num-examples"; add '
        'MetricRecord({"num-examples": len(trainset)}) under "metrics"; nothing was submitted'
    )


def plan_app_round(runtime: ClientRuntime, task: TaskConfig) -> PrivacyPlan:
    """The round's privacy plan, refusing DP-SGD (it runs inside training, which is the app's).

    Clipping and update noise are applied to the app's update as to any other, so a round with
    update noise is private and accounted; without DP-SGD the plan does not depend on how many
    records the app trains on.
    """
    if task.dp_target_epsilon > 0 or task.dp_noise_multiplier > 0:
        raise PrivacyRefusal(
            f"round {task.round}: the task asks for DP-SGD (per-example clipping and noise inside "
            "training), which zoo-gym cannot apply inside your own ClientApp; not training. Join "
            "without --app to take such rounds, or ask the operator for update noise instead"
        )
    return plan_round(
        task, num_records=1, account=runtime.state.privacy, budget=runtime.privacy_budget
    )


def train_with_app(
    runtime: ClientRuntime, app: ClientApp, message: Message, context: Context
) -> Message:
    """zoo-gym's reply to the task `message`, trained by the contributor's own `app`."""
    task = runtime.task_of(message)
    check_adapter(task)
    plan = plan_app_round(runtime, task)  # refuses before anything is trained
    directory = runtime.base_directory(task.base_version)
    tensors = round_tensors(directory, task)
    runtime.based_on(task.base_version)
    runtime.on_event(RoundEvent("privacy", plan.round, dict(plan.metrics())))
    request = train_message(message, task, tensors, directory)
    with phase("train", f"round {task.round}, your ClientApp"):
        started = time.perf_counter()
        reply = app(request, context)
        seconds = time.perf_counter() - started
    result = reply_result(reply, tensors, task.round, seconds)
    return runtime.reply(
        message, task, plan, result, spec=task_spec(task), in_features=tensors.in_features
    )
