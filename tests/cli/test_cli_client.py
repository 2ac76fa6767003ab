"""`gym-client`: help everywhere, `status` (table and JSON) from real state files, config overrides,
and `join` against a real coordinator that stops at the privacy budget."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from opacus.accountants import RDPAccountant
from typer.testing import CliRunner

from zoo_gym.cli.client import app
from zoo_gym.cli.progress import JoinDisplay, privacy_text, size_text
from zoo_gym.client.privacy import PrivacyAccount, plan_round
from zoo_gym.client.runtime import RoundEvent
from zoo_gym.client.state import LocalState, RoundRecord
from zoo_gym.core.protocol import TaskConfig
from zoo_gym.simulation.demo import Federation

runner = CliRunner()


def rdp(history: list[tuple[float, float, int]], delta: float = 1e-5) -> float:
    acc = RDPAccountant()
    acc.history = list(history)
    return float(acc.get_epsilon(delta=delta))


@pytest.mark.parametrize("command", [[], ["init"], ["join"], ["status"], ["rewards"]])
def test_every_command_has_help(command: list[str]) -> None:
    result = runner.invoke(app, [*command, "--help"])

    assert result.exit_code == 0, result.output
    assert "Usage" in result.output


def contributor(tmp_path: Path, budget: float | None = 8.0) -> Path:
    """A home made by `gym-client init`, with two DP rounds in its state file."""
    home = tmp_path / "alice"
    assert runner.invoke(app, ["init", "--home", str(home), "--name", "alice"]).exit_code == 0
    if budget is not None:
        with (home / "client.toml").open("a") as fh:
            fh.write(f"privacy_budget_epsilon = {budget}\n")
    state = LocalState.load(home / "state" / "state.json")
    state.path.parent.mkdir(parents=True)
    state.contributor_id, state.coordinator = "ab" * 32, "127.0.0.1:7443"
    for r, sigma in ((1, 1.0), (2, 2.0)):
        task = TaskConfig(
            round=r, base_version=f"v000{r - 1}", seed=r, dp_noise_multiplier=sigma, batch_size=8
        )
        state.privacy.commit(plan_round(task, num_records=80, account=state.privacy))
        state.record(
            RoundRecord(
                round=r,
                message_id=f"m{r}",
                base_version=f"v000{r - 1}",
                decision="accepted",
                reason="accepted at intake",
                payload_bytes=1000,
                raw_bytes=14000,
                train_loss=1.5 - 0.1 * r,
                reward=50.0,
                final=True,
            )
        )
    return home


def test_status_json_reports_contributions_and_privacy_against_the_budget(tmp_path: Path) -> None:
    home = contributor(tmp_path)

    result = runner.invoke(app, ["status", "--home", str(home), "--format", "json"])

    assert result.exit_code == 0, result.output
    body = json.loads(result.stdout)
    assert body["contributor_id"] == "ab" * 32 and [c["round"] for c in body["contributions"]] == [
        1,
        2,
    ]
    p = body["privacy"]
    total = rdp([(1.0, 0.1, 30), (2.0, 0.1, 30)])
    assert p["epsilon_total"] == pytest.approx(total, rel=1e-9)
    assert p["budget_epsilon"] == 8.0 and p["rounds"] == 2 and p["accountant"] == "rdp"
    assert body["contributions"][0]["epsilon"] == pytest.approx(rdp([(1.0, 0.1, 30)]), rel=1e-9)
    assert body["contributions"][1]["epsilon_total"] == pytest.approx(total, rel=1e-9)
    assert p["naive_epsilon_sum"] == pytest.approx(rdp([(1.0, 0.1, 30)]) + rdp([(2.0, 0.1, 30)]))
    assert p["user_epsilon_total"] is None  # no update noise: no user-level guarantee


def test_status_table_says_what_is_spent_of_the_budget(tmp_path: Path) -> None:
    home = contributor(tmp_path, budget=None)

    result = runner.invoke(app, ["status", "--home", str(home)], env={"COLUMNS": "200"})

    assert result.exit_code == 0, result.output
    total = rdp([(1.0, 0.1, 30), (2.0, 0.1, 30)])
    assert (
        f"privacy: epsilon {total:.3g} (no budget set) spent over 2 round(s) at delta 1e-05 (rdp)"
        in result.output
    )
    assert "accepted at intake" in result.output


def test_status_of_a_fresh_home_and_a_bad_format(tmp_path: Path) -> None:
    result = runner.invoke(app, ["status", "--home", str(tmp_path), "--format", "json"])
    assert result.exit_code == 0 and json.loads(result.stdout)["privacy"]["epsilon_total"] == 0.0

    bad = runner.invoke(app, ["status", "--home", str(tmp_path), "--format", "yaml"])
    assert bad.exit_code == 2 and "yaml" in bad.output


def test_join_option_overrides_are_validated_like_the_file(tmp_path: Path) -> None:
    home = contributor(tmp_path)

    result = runner.invoke(
        app, ["join", "127.0.0.1:1", "--home", str(home), "--privacy-budget-epsilon", "-1"]
    )

    assert result.exit_code == 1
    assert "error: --privacy-budget-epsilon: Input should be greater than 0" in result.output


def test_display_lines_without_a_terminal() -> None:
    from rich.console import Console

    console = Console(record=True, width=200, force_terminal=False)
    plan = plan_round(
        TaskConfig(round=3, base_version="v2", seed=1, dp_noise_multiplier=1.0, batch_size=8),
        num_records=80,
        account=PrivacyAccount(),
    )
    with JoinDisplay(console) as display:
        display.event(RoundEvent("base", 0, {"version": "v0002"}))
        display.event(RoundEvent("privacy", 3, dict(plan.metrics())))
        for step in (1, 2):
            display.event(
                RoundEvent(
                    "step", 3, {"step": step, "steps": 2, "loss": 1.25, "tokens_per_s": 900.0}
                )
            )
        display.event(RoundEvent("compressed", 3, {"raw_bytes": 14336, "payload_bytes": 1024}))

    text = console.export_text()
    eps = rdp([(1.0, 0.1, 30)])
    assert "base model v0002 loaded" in text
    assert (
        f"round 3 privacy: DP-SGD sigma 1 at q 0.1; epsilon {eps:.3g} this round, {eps:.3g} total"
        in text
    )
    assert "round 3: 2 steps, last loss 1.2500, 900 tok/s" in text
    assert "round 3: update 14.0 KiB as bf16 -> 1.0 KiB compressed (14.0x smaller)" in text
    assert size_text(10) == "10 B" and privacy_text({}) == "no differential privacy this round"


@pytest.mark.e2e
@pytest.mark.slow
def test_join_trains_within_budget_then_stops_before_exceeding_it(tmp_path: Path) -> None:
    # Prepare: a real coordinator (one client, DP-SGD at epsilon 1 per round) and a budget of 1.5
    fed = Federation(tmp_path / "fed", clients=1, rounds=3, steps=6, examples_per_client=40)
    with fed:
        fed.prepare()
        with (fed.coordinator_home / "coordinator.toml").open("a") as fh:  # under [training]
            fh.write("dp_target_epsilon = 1.0\nclip_norm = 1.0\nbatch_size = 8\n")
        coordinator = fed._spawn(
            "coordinator",
            [
                sys.executable,
                "-m",
                "zoo_gym.cli.coordinator",
                "serve",
                "-c",
                str(fed.coordinator_home / "coordinator.toml"),
            ],
        )
        client = fed.start_client(0, "--privacy-budget-epsilon", "1.5")

        # Execute
        code = client.wait(timeout=300)
        coordinator_alive = coordinator.poll() is None

    # Assert: rounds 1 and 2 fit (RDP composition: 0.998 then 1.34; the naive sum would be 1.996),
    # round 3 was refused before training, with one line
    log = (tmp_path / "fed" / "client-0.log").read_text()
    assert code == 0 and coordinator_alive, log[-3000:]
    assert "joined 127.0.0.1:" in log and "base model v0000 loaded" in log
    assert "device: cpu (float32, " in log  # device = "auto" on a machine without CUDA
    assert "round 1 privacy: DP-SGD sigma" in log and "this round" in log
    assert "as bf16 -> " in log and "accepted: accepted at intake" in log
    assert "stopped: privacy budget: round 3 would bring your epsilon to" in log, log
    assert "Traceback" not in log
    state = json.loads((fed.client_home(0) / "state" / "state.json").read_text())
    assert sorted(c["round"] for c in state["contributions"].values()) == [1, 2]
    first, second = state["privacy"]["rounds"]
    sigma = first["dp_noise_multiplier"]
    assert first["epsilon"] <= 1.0
    assert first["epsilon"] == pytest.approx(rdp([(sigma, 8 / 40, 6)]), rel=1e-9)
    assert second["epsilon_total"] == pytest.approx(rdp([(sigma, 8 / 40, 12)]), rel=1e-9)
    assert second["epsilon_total"] < 1.5 < first["epsilon"] + second["epsilon"]
    assert "Warning" not in log


def test_status_shows_the_error_feedback_residual_against_the_update(tmp_path: Path) -> None:
    import torch

    from zoo_gym.client.feedback import FfaErrorFeedback
    from zoo_gym.compression import CodecSpec
    from zoo_gym.core.lora import LoraSpec

    home = contributor(tmp_path, budget=None)
    feedback = FfaErrorFeedback()
    update = {"m.q_proj.lora_B": torch.randn(16, 4)}
    feedback.compress(
        update,
        CodecSpec("bitdelta"),
        lora=LoraSpec(rank=4),
        seed=11,
        in_features={"m.q_proj": 32},
        round=3,
    )
    feedback.save(home / "state" / "feedback.safetensors")

    table = runner.invoke(app, ["status", "--home", str(home)], env={"COLUMNS": "200"})
    body = json.loads(
        runner.invoke(app, ["status", "--home", str(home), "--format", "json"]).stdout
    )

    assert "residual 256 B kept for a 256 B float32 update; A seed 11 since round 3" in table.output
    assert body["feedback"] == {
        "residual_bytes": 256,
        "update_bytes": 256,
        "a_seed": 11,
        "a_since": 3,
        "round": 3,
    }
