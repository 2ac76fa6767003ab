"""`gym-client join --app`: a contributor's own Flower ClientApp (`flower_quickstart_app`, written
as Flower's quickstarts write one) trains served rounds; zoo-gym turns its reply into the
round's update, clips, compresses, signs and submits it, and refuses a bad reply with one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import flower_quickstart_app
import pytest
import torch
from flwr.app import ConfigRecord, Context, Message, RecordDict
from safetensors.torch import load_file
from served_round import Served, contributor, serving
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from zoo_gym.cli.client import app as gym_client
from zoo_gym.client.errors import RoundRefusal
from zoo_gym.client.privacy import PrivacyRefusal
from zoo_gym.client.runtime import ClientRuntime, RoundEvent
from zoo_gym.client.session import JoinError, join
from zoo_gym.client.user_app import (
    UserAppError,
    load_client_app,
    peft_key,
    round_tensors,
    train_with_app,
)
from zoo_gym.compression import CodecSpec, decode, encode
from zoo_gym.core.delta import Delta
from zoo_gym.core.identity import Identity
from zoo_gym.core.lora import frozen_a, update_key
from zoo_gym.core.protocol import TASK_CONFIG, TaskConfig
from zoo_gym.core.tiny import tiny_config
from zoo_gym.core.weights import load_weights
from zoo_gym.transport.flower_internals import set_task_identity

APP = "flower_quickstart_app:app"
HERE = Path(__file__).resolve().parent
TARGETS = '["q_proj", "v_proj"]'
RANK, ALPHA = 4, 8.0
CLIP = 0.05  # every update here is longer: the submitted one is clipped


def clipped(update: Delta, norm: float) -> Delta:
    """`update` scaled to L2 norm at most `norm` (over all its tensors)."""
    total = torch.sqrt(sum((t.double() ** 2).sum() for t in update.values())).item()
    factor = min(1.0, norm / total)
    return {k: (t.double() * factor).float() for k, t in update.items()}


def expected_update(
    adapter: str, base: dict[str, torch.Tensor], new: dict[str, torch.Tensor]
) -> Delta:
    """What the app's new values mean as the round's update, computed here from its reply."""
    if adapter == "full":
        return {k: new[k] - base[k] for k in base}
    modules = sorted(
        k.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
        for k in new
        if ".lora_A." in k
    )
    if adapter == "ffa_lora":
        return {update_key(m): new[peft_key(m, "lora_B")] for m in modules}
    return {
        m + ".weight": (ALPHA / RANK) * new[peft_key(m, "lora_B")] @ new[peft_key(m, "lora_A")]
        for m in modules
    }


def run_round(
    tmp_path: Path, served: Served, **settings: object
) -> tuple[int, list[str], list[RoundEvent], Identity]:
    config, me = contributor(tmp_path / "alice", served.address, app=APP, **settings)
    lines: list[str] = []
    events: list[RoundEvent] = []
    made = join(config, say=lines.append, on_event=events.append)
    return made, lines, events, me


@pytest.mark.parametrize("adapter", ["full", "lora", "ffa_lora"])
def test_a_quickstart_app_trains_a_served_round_and_its_clipped_update_is_accepted(
    tiny_home: Path, tmp_path: Path, adapter: str
) -> None:
    # Prepare: a coordinator serving one round of `adapter`, codec none (what is sent is exact)
    training = {
        "adapter": f'"{adapter}"',
        "codec": '"none"',
        "clip_norm": CLIP,
        "steps": 3,
        "learning_rate": 0.01,
        "lora_rank": RANK,
        "lora_alpha": ALPHA,
        "target_modules": TARGETS,
    }
    flower_quickstart_app.REPLIES.clear()
    with serving(tiny_home, training) as served:
        base = served.base()

        # Execute
        made, lines, events, me = run_round(tmp_path, served)

        # Assert: accepted, in the ledger, and what arrived is the app's new weights minus the
        # base, clipped to CLIP
        rows = served.submissions(me)
        received = served.received(rows[0])
    assert made == 1, lines
    assert [(r.round_number, r.decision) for r in rows] == [(1, "accepted")]
    (new,) = flower_quickstart_app.REPLIES
    want = clipped(expected_update(adapter, base, new), CLIP)
    assert sorted(received) == sorted(want)
    for name, tensor in want.items():
        torch.testing.assert_close(received[name], tensor, rtol=1e-5, atol=1e-8)
    norm = torch.sqrt(sum((t.double() ** 2).sum() for t in received.values())).item()
    assert norm == pytest.approx(CLIP, rel=1e-5)
    assert [e.kind for e in events] == ["base", "privacy", "compressed"]
    assert any(line.startswith("round 1: uploaded") and "accepted" in line for line in lines), lines
    state = json.loads((tmp_path / "alice" / "state" / "state.json").read_text())
    (record,) = state["contributions"].values()
    assert record["decision"] == "accepted" and record["round"] == 1
    assert len(state["privacy"]["rounds"]) == 1


@pytest.mark.parametrize(
    ("adapter", "fault", "says"),
    [
        ("full", "missing-key", "lacks 1 of the"),
        ("full", "wrong-shape", "of shape (300, 64); it was sent as (301, 64)"),
        ("full", "non-finite", "has NaN or infinite values in 'lm_head.weight'"),
        ("full", "no-num-examples", 'has no MetricRecord with "num-examples"'),
        ("ffa_lora", "trained-a", "an ffa_lora round trains only the B matrices"),
    ],
)
def test_a_bad_reply_stops_join_with_one_line_and_submits_nothing(
    tiny_home: Path, tmp_path: Path, adapter: str, fault: str, says: str
) -> None:
    # Prepare: the app spoils its reply as `fault` says
    training = {"adapter": f'"{adapter}"', "steps": 1, "target_modules": TARGETS}
    with serving(tiny_home, training) as served:
        # Execute
        with pytest.raises(JoinError) as refused:
            run_round(tmp_path, served, node_config={"fault": fault})

        # Assert: one line naming what was wrong; nothing reached the coordinator, nothing was
        # spent or carried on this machine
        submissions = served.submissions(Identity.load(tmp_path / "alice" / "client.key"))
    message = str(refused.value)
    assert message.startswith("round 1: your ClientApp") and says in message, message
    assert "\n" not in message and message.endswith("nothing was submitted")
    assert submissions == []
    state = json.loads((tmp_path / "alice" / "state" / "state.json").read_text())
    assert state["contributions"] == {} and state["privacy"]["rounds"] == []
    assert not (tmp_path / "alice" / "state" / "feedback.safetensors").exists()


@pytest.mark.e2e
def test_gym_client_join_app_in_its_own_process_takes_a_lora_round_in_bitdelta(
    tiny_home: Path, tmp_path: Path
) -> None:
    # Prepare: a LoRA round in BitDelta, and a contributor made by `gym-client init` whose
    # client.toml names the app and gives it a [node_config] table
    training = {
        "adapter": '"lora"',
        "codec": '"bitdelta"',
        "clip_norm": CLIP,
        "steps": 3,
        "learning_rate": 0.01,
        "lora_rank": RANK,
        "lora_alpha": ALPHA,
        "target_modules": TARGETS,
    }
    home, replies = tmp_path / "alice", tmp_path / "replies"
    replies.mkdir()
    assert CliRunner().invoke(gym_client, ["init", "--home", str(home)]).exit_code == 0
    with (home / "client.toml").open("a") as fh:
        fh.write(f'app = "{APP}"\n\n[node_config]\nreplies = "{replies}"\n')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parents[1])])}
    with serving(tiny_home, training) as served:
        # Execute
        args = ["join", served.address, "--home", str(home), "--max-rounds", "1"]
        done = subprocess.run(
            [sys.executable, "-m", "zoo_gym.cli.client", *args],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
        )

        # Assert: accepted; what arrived is BitDelta of the clipped s·B·A (signs and one scale,
        # the mean |value|, per group of 128), computed here from the app's reply
        (row,) = served.submissions(Identity.load(home / "client.key"))
        received = served.received(row)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert (
        "accepted" in output
        and "left after 1 submission(s)" in output
        and "Traceback" not in output
    )
    assert row.decision == "accepted"
    new = load_file(replies / "round-1.safetensors")
    want = clipped(expected_update("lora", {}, new), CLIP)
    sent = decode(encode(want, CodecSpec("bitdelta", 128)), max_elements=1 << 20)
    assert (
        sorted(received)
        == sorted(want)
        == [
            f"model.layers.{i}.self_attn.{m}.weight" for i in range(2) for m in ("q_proj", "v_proj")
        ]
    )
    for name in want:
        torch.testing.assert_close(received[name], sent[name], rtol=1e-5, atol=1e-9)
    # the coordinator holds the update: what BitDelta dropped is kept for the next round
    residual = load_file(home / "state" / "feedback.safetensors")
    for name in want:
        torch.testing.assert_close(residual[name], want[name] - sent[name], rtol=1e-4, atol=1e-7)


def task_message(**task: object) -> Message:
    set_task_identity(run_id=1, node_id=0, task_id=1)  # the coordinator makes the task message
    record = TaskConfig(round=2, base_version="v0001", seed=7, **task).to_record()  # type: ignore[arg-type]
    return Message(RecordDict({TASK_CONFIG: ConfigRecord(record)}), 1, "train")


def never_downloaded(version: str, directory: Path) -> None:
    raise AssertionError(f"{version} was downloaded for a round that must be refused first")


@pytest.mark.parametrize(
    ("task", "refusal", "says"),
    [
        (
            {"dp_noise_multiplier": 1.0},
            PrivacyRefusal,
            "round 2: the task asks for DP-SGD (per-example clipping and noise inside training), "
            "which zoo-gym cannot apply inside your own ClientApp",
        ),
        (
            {"dp_target_epsilon": 4.0},
            PrivacyRefusal,
            "round 2: the task asks for DP-SGD",
        ),
        (
            {"adapter": "dora"},
            RoundRefusal,
            "round 2 uses the dora adapter, which zoo-gym does not hand to a ClientApp of your own "
            "(it hands full, lora, ffa_lora)",
        ),
    ],
)
def test_rounds_an_app_cannot_take_are_refused_before_anything_is_fetched_or_trained(
    tmp_path: Path, task: dict[str, object], refusal: type[Exception], says: str
) -> None:
    runtime = ClientRuntime(
        identity=Identity.generate(),
        conversations=[],
        home=tmp_path / "state",
        model_source=never_downloaded,
    )
    flower_quickstart_app.REPLIES.clear()
    context = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})

    with pytest.raises(refusal) as refused:
        train_with_app(runtime, flower_quickstart_app.app, task_message(**task), context)

    assert str(refused.value).startswith(says), str(refused.value)
    assert flower_quickstart_app.REPLIES == [] and runtime.state.privacy.rounds == []


@pytest.mark.parametrize(
    ("path", "says"),
    [
        ("flower_quickstart_app", "app 'flower_quickstart_app' is not MODULE:ATTRIBUTE"),
        ("no_such_package.client_app:app", "no module named 'no_such_package'; install"),
        ("flower_quickstart_app:application", "has no attribute 'application'"),
        (
            "flower_quickstart_app:train_fn",
            "train_fn is a function, not a flwr.clientapp.ClientApp",
        ),
    ],
)
def test_an_app_that_cannot_be_loaded_is_one_line(path: str, says: str) -> None:
    with pytest.raises(UserAppError) as refused:
        load_client_app(path)

    assert says in str(refused.value) and "\n" not in str(refused.value)


def test_join_refuses_an_app_it_cannot_load_before_contacting_the_coordinator(
    tmp_path: Path,
) -> None:
    config, _ = contributor(tmp_path / "alice", "127.0.0.1:1", app="flower_quickstart_app:nope")

    with pytest.raises(JoinError, match="module flower_quickstart_app has no attribute 'nope'"):
        join(config, say=lambda line: None)

    runner, home = CliRunner(), str(tmp_path / "bob")
    assert runner.invoke(gym_client, ["init", "--home", home]).exit_code == 0
    bad = runner.invoke(gym_client, ["join", "127.0.0.1:1", "--home", home, "--app", "x.y"])
    assert bad.exit_code == 1
    assert (
        "error: --app: app must be MODULE:ATTRIBUTE, like package.module:app, not 'x.y'"
        in bad.output
    )


def test_full_rounds_send_every_state_dict_name_and_update_a_tied_weight_once(
    tmp_path: Path,
) -> None:
    # Prepare: a tiny model whose output layer shares the embedding (stored once in its files)
    config = tiny_config(vocab_size=64)
    config.tie_word_embeddings = True
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path / "tied")
    stored = load_weights(tmp_path / "tied")

    # Execute
    tensors = round_tensors(
        tmp_path / "tied", TaskConfig(round=1, base_version="v", seed=1, adapter="full")
    )
    update = tensors.update({k: v + 0.5 for k, v in tensors.arrays.items()}, round=1)

    # Assert: the app can load_state_dict(strict=True) what it gets; the update has each stored
    # weight once
    assert "lm_head.weight" not in stored
    assert sorted(tensors.arrays) == sorted(model.state_dict())
    assert tensors.stored_as["lm_head.weight"] == "model.embed_tokens.weight"
    torch.testing.assert_close(
        tensors.arrays["lm_head.weight"], stored["model.embed_tokens.weight"]
    )
    assert sorted(update) == sorted(stored)
    for t in update.values():  # (v + 0.5) - v, exact to float32 rounding
        torch.testing.assert_close(t, torch.full_like(t, 0.5), rtol=0, atol=1e-6)


def test_lora_rounds_send_peft_s_adapter_state_dict_starting_at_the_base(tiny_home: Path) -> None:
    task = TaskConfig(
        round=3,
        base_version="v",
        seed=5,
        a_seed=11,
        adapter="lora",
        lora_rank=RANK,
        target_modules=("q_proj",),
    )

    tensors = round_tensors(tiny_home / "base", task)

    assert sorted(tensors.arrays) == [
        f"base_model.model.model.layers.{i}.self_attn.q_proj.lora_{f}.weight"
        for i in range(2)
        for f in "AB"
    ]
    a = tensors.arrays[peft_key("model.layers.1.self_attn.q_proj", "lora_A")]
    b = tensors.arrays[peft_key("model.layers.1.self_attn.q_proj", "lora_B")]
    assert torch.equal(a, frozen_a(11, "model.layers.1.self_attn.q_proj", 64, RANK))
    assert torch.equal(b, torch.zeros(64, RANK))
    assert tensors.in_features == {f"model.layers.{i}.self_attn.q_proj": 64 for i in range(2)}
