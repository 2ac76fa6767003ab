"""The contributor's privacy plan: sigma for a target epsilon, composition across rounds, the budget,
update noise, and the epsilon that reaches the ledger and the published manifest."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from flwr.app import ConfigRecord, Message, RecordDict
from opacus.accountants import PRVAccountant, RDPAccountant
from sqlmodel import Session

from zoo_gym import ledger
from zoo_gym.client.errors import RoundRefusal
from zoo_gym.client.privacy import PrivacyAccount, PrivacyBudget, PrivacyRefusal, plan_round
from zoo_gym.client.runtime import ClientRuntime, RoundEvent
from zoo_gym.client.state import LocalState
from zoo_gym.compression import decode
from zoo_gym.core.chat import to_conversation
from zoo_gym.core.identity import Identity
from zoo_gym.core.manifest import read_verified
from zoo_gym.core.protocol import PAYLOAD, SUBMISSION, TASK_CONFIG, TRAIN_METRICS, TaskConfig
from zoo_gym.core.synthetic import make_examples, shard
from zoo_gym.simulation.inprocess import InProcessFederation
from zoo_gym.transport.flower_internals import set_task_identity

DELTA = 1e-5


def task(round_number: int = 1, **fields: object) -> TaskConfig:
    base: dict[str, object] = {
        "round": round_number,
        "base_version": "v0000",
        "seed": 7,
        "steps": 30,
        "batch_size": 8,
    }
    return TaskConfig(**{**base, **fields})  # type: ignore[arg-type]


def reference(name: str, history: list[tuple[float, float, int]]) -> float:
    acc = RDPAccountant() if name == "rdp" else PRVAccountant()
    for sigma, q, steps in history:
        for _ in range(steps):
            acc.step(noise_multiplier=sigma, sample_rate=q)
    return float(acc.get_epsilon(delta=DELTA))


@pytest.mark.parametrize("name", ["rdp", "prv"])
def test_sigma_for_a_target_lands_at_or_below_it(name: str) -> None:
    plan = plan_round(
        task(dp_target_epsilon=2.0, dp_accountant=name), num_records=200, account=PrivacyAccount()
    )

    assert plan.sample_rate == 8 / 200 and plan.dp_sgd
    assert plan.epsilon is not None and 2.0 - 0.05 < plan.epsilon <= 2.0
    assert plan.epsilon == pytest.approx(
        reference(name, [(plan.dp_noise_multiplier, 0.04, 30)]), rel=1e-6
    )
    assert reference(name, [(plan.dp_noise_multiplier * 0.95, 0.04, 30)]) > 2.0  # no slack left
    assert (
        plan.user_epsilon is None and plan.user_epsilon_total is None
    )  # no update noise: no user-level DP


@pytest.mark.parametrize("name", ["rdp", "prv"])
def test_rounds_compose_like_one_opacus_accountant(name: str) -> None:
    # Prepare: three rounds with different sigma, sample rate and steps
    account = PrivacyAccount()
    rounds = [
        task(1, dp_noise_multiplier=1.0, dp_accountant=name),
        task(2, dp_noise_multiplier=1.5, batch_size=16, steps=20, dp_accountant=name),
        task(3, dp_target_epsilon=1.0, dp_accountant=name),
    ]

    # Execute
    plans = []
    for t in rounds:
        plans.append(plan_round(t, num_records=100, account=account))
        account.commit(plans[-1])

    # Assert: the running total is the accountant over the whole history, not a sum
    history = [(p.dp_noise_multiplier, p.sample_rate, p.steps) for p in plans]
    assert history[:2] == [(1.0, 0.08, 30), (1.5, 0.16, 20)]
    for i, p in enumerate(plans):
        assert p.epsilon == pytest.approx(reference(name, history[i : i + 1]), rel=1e-6)
        assert p.epsilon_total == pytest.approx(reference(name, history[: i + 1]), rel=1e-6)
    assert account.total(DELTA, name) == pytest.approx(plans[-1].epsilon_total)
    naive = sum(p.epsilon for p in plans if p.epsilon is not None)
    assert account.naive_epsilon_sum == pytest.approx(naive)
    assert plans[-1].epsilon_total is not None and plans[-1].epsilon_total < naive


def test_update_noise_is_a_gaussian_mechanism_at_half_the_multiplier() -> None:
    # replace-one adjacency: two clipped updates are up to 2C apart, noise std z*C -> sigma z/2
    plan = plan_round(
        task(method="grpo", clip_norm=0.5, update_noise_multiplier=4.0),
        num_records=10,
        account=PrivacyAccount(),
    )

    assert plan.user_mechanisms == ((2.0, 1.0, 1),) and plan.update_noise_std == 2.0
    assert plan.user_epsilon == pytest.approx(reference("rdp", [(2.0, 1.0, 1)]), rel=1e-6)
    assert (
        plan.epsilon == plan.user_epsilon
    )  # without DP-SGD a record is protected by the same mechanism
    assert not plan.dp_sgd


def test_dp_sgd_is_refused_where_it_cannot_be_given() -> None:
    with pytest.raises(PrivacyRefusal, match="clip_norm > 0"):
        plan_round(task(update_noise_multiplier=1.0), num_records=10, account=PrivacyAccount())
    with pytest.raises(PrivacyRefusal, match="no noise level reaches epsilon 1e-06"):
        plan_round(
            task(dp_target_epsilon=1e-6, batch_size=10), num_records=10, account=PrivacyAccount()
        )


def test_budget_refuses_the_round_that_would_exceed_it() -> None:
    # Prepare: two rounds at sigma 1.0 spent; a budget between the 2- and the 3-round totals
    account = PrivacyAccount()
    for r in (1, 2):
        account.commit(
            plan_round(task(r, dp_noise_multiplier=1.0), num_records=100, account=account)
        )
    two = reference("rdp", [(1.0, 0.08, 60)])
    three = reference("rdp", [(1.0, 0.08, 90)])
    budget = PrivacyBudget(epsilon=(two + three) / 2)

    # Execute / Assert: the third round is refused with one line naming both numbers
    with pytest.raises(PrivacyRefusal) as refused:
        plan_round(
            task(3, dp_noise_multiplier=1.0), num_records=100, account=account, budget=budget
        )
    message = str(refused.value)
    assert "\n" not in message
    assert f"would bring your epsilon to {three:.3f} (spent {two:.3f})" in message
    assert "raise privacy_budget_epsilon in client.toml" in message
    # a cheaper round (more noise) still fits; the budget's own delta is the one checked
    plan_round(task(3, dp_noise_multiplier=5.0), num_records=100, account=account, budget=budget)
    with pytest.raises(PrivacyRefusal, match="at delta 1e-08"):
        plan_round(
            task(3, dp_noise_multiplier=5.0),
            num_records=100,
            account=account,
            budget=PrivacyBudget(epsilon=two + 0.01, delta=1e-8),
        )


def test_budget_refuses_rounds_without_dp_and_data_already_released_without_it() -> None:
    account = PrivacyAccount()
    with pytest.raises(PrivacyRefusal, match="trains without differential privacy"):
        plan_round(task(1), num_records=100, account=account, budget=PrivacyBudget(10.0))
    account.commit(
        plan_round(task(1), num_records=100, account=account)
    )  # joined without a budget once

    assert account.total(DELTA) is None
    with pytest.raises(PrivacyRefusal, match=r"round\(s\) 1 released updates without DP"):
        plan_round(
            task(2, dp_noise_multiplier=2.0),
            num_records=100,
            account=account,
            budget=PrivacyBudget(10.0),
        )


def test_account_survives_a_restart(tmp_path: Path) -> None:
    state = LocalState.load(tmp_path / "state.json")
    plan = plan_round(
        task(1, dp_noise_multiplier=1.2, clip_norm=1.0, update_noise_multiplier=2.0),
        num_records=50,
        account=state.privacy,
    )
    state.privacy.commit(plan)
    state.save()

    again = LocalState.load(tmp_path / "state.json")

    assert again.privacy == state.privacy
    assert again.privacy.sample_history == [(1.2, 0.16, 30)] and again.privacy.user_history == [
        (1.0, 1.0, 1)
    ]
    assert (
        json.loads((tmp_path / "state.json").read_text())["privacy"]["rounds"][0]["epsilon"]
        == plan.epsilon
    )


# -- through the runtime, on the tiny model -------------------------------------------------------


@pytest.fixture(scope="module")
def base_dir(tiny_home_template: Path) -> Path:
    return tiny_home_template / "base"  # the tiny base, seed 0; copied, never written


def runtime(
    home: Path,
    base_dir: Path,
    budget: PrivacyBudget | None = None,
    events: list[RoundEvent] | None = None,
) -> ClientRuntime:
    def source(version: str, directory: Path) -> None:
        import shutil

        if not directory.exists():
            shutil.copytree(base_dir, directory)

    records = make_examples(40, seed=3)
    return ClientRuntime(
        identity=Identity.generate(),
        conversations=[to_conversation(r) for r in records],
        home=home,
        model_source=source,
        privacy_budget=budget,
        on_event=events.append if events is not None else None,
    )


def message(t: TaskConfig) -> Message:
    """A round task as the ServerApp creates it (run 1, node 0)."""
    set_task_identity(run_id=1, node_id=0, task_id=1)
    return Message(RecordDict({TASK_CONFIG: ConfigRecord(t.to_record())}), 1, "train")


def test_runtime_refuses_over_budget_before_loading_anything(
    tmp_path: Path, base_dir: Path
) -> None:
    rt = runtime(tmp_path, base_dir, budget=PrivacyBudget(epsilon=0.5))

    with pytest.raises(PrivacyRefusal, match=r"past your budget of 0\.5"):
        rt.train(message(task(1, dp_target_epsilon=1.0)))

    assert rt.trainer is None and not (tmp_path / "models").exists()
    assert LocalState.load(tmp_path / "state.json").privacy.rounds == []


def test_update_noise_has_the_planned_std_and_is_accounted(tmp_path: Path, base_dir: Path) -> None:
    # Prepare: one tiny step, so the clipped update (norm <= C) is small beside noise of std z*C
    events: list[RoundEvent] = []
    rt = runtime(tmp_path, base_dir, events=events)
    t = task(
        1, steps=1, learning_rate=1e-6, codec="none", clip_norm=0.01, update_noise_multiplier=3.0
    )

    # Execute
    reply = rt.train(message(t))

    # Assert: the decoded update is noise of std 0.03 (the signal has norm <= 0.01 over all values)
    payload = bytes(reply.content.config_records[SUBMISSION][PAYLOAD])  # type: ignore[arg-type]
    values = torch.cat([v.flatten() for v in decode(payload, max_elements=10**8).values()])
    assert values.numel() > 5000
    assert float(values.std()) == pytest.approx(0.03, rel=0.05)
    assert abs(float(values.mean())) < 0.03 * 5 / math.sqrt(values.numel())
    metrics = reply.content.metric_records[TRAIN_METRICS]
    assert metrics["update_noise_multiplier"] == 3.0 and metrics["dp_noise_multiplier"] == 0.0
    assert metrics["user_epsilon"] == pytest.approx(reference("rdp", [(1.5, 1.0, 1)]), rel=1e-6)
    assert [e.kind for e in events if e.kind in ("privacy", "compressed")] == [
        "privacy",
        "compressed",
    ]
    assert LocalState.load(tmp_path / "state.json").privacy.user_history == [(1.5, 1.0, 1)]


def test_dp_round_reports_epsilon_to_the_ledger_and_the_manifest(tiny_home: Path) -> None:
    # Prepare: two clients with 30 and 20 records, DP-SGD at a per-round target of 8
    shards = shard(make_examples(50, seed=5), 2)
    shards = [shards[0] + shards[1][:5], shards[1][5:]]
    training = {
        "steps": 4,
        "batch_size": 5,
        "dp_target_epsilon": 8.0,
        "dp_delta": DELTA,
        "clip_norm": 1.0,
    }
    fed = InProcessFederation.build(
        tiny_home,
        shards,
        overrides={
            "rounds": 1,
            "min_clients": 2,
            "aggregator": "fedavg",
            "quality_gate_tolerance": 10.0,
            "training": training,
        },
    )

    # Execute
    (summary,) = fed.run()

    # Assert: each client's epsilon is the accountant's at its own sample rate and reached the ledger
    assert summary.status == "published"
    with Session(fed.coordinator.engine) as session:
        rows = ledger.list_submissions(session, round_number=1)
        recorded = {s.contributor_id: s.epsilon for s in rows}
        stated = {s.contributor_id: s.dp_mechanism for s in rows}
    for rt in fed.runtimes.values():
        (spent,) = rt.state.privacy.rounds
        assert spent.sample_rate == 5 / len(rt.conversations)
        assert spent.epsilon == pytest.approx(
            reference("rdp", [(spent.dp_noise_multiplier, spent.sample_rate, 4)])
        )
        assert spent.epsilon is not None and spent.epsilon <= 8.0
        assert recorded[rt.identity.contributor_id] == pytest.approx(spent.epsilon)
        # the mechanism behind it reached the ledger too, so the coordinator can compose rounds
        assert stated[rt.identity.contributor_id] == ledger.DpMechanism(
            spent.dp_noise_multiplier, spent.sample_rate, 4, DELTA, "rdp"
        )
    published = read_verified(
        fed.coordinator.registry.root / summary.published_version, fed.coordinator.signer.public_key
    )
    assert published.epsilon == pytest.approx(max(v for v in recorded.values() if v is not None))


@pytest.mark.parametrize(
    ("adapter", "method"),
    [("dora", "sft"), ("qlora", "sft"), ("full", "sft"), ("ffa_lora", "grpo"), ("lora", "gspo")],
)
def test_a_dp_sgd_round_trains_every_adapter_and_objective(
    tmp_path: Path, base_dir: Path, adapter: str, method: str
) -> None:
    if adapter == "qlora":
        pytest.importorskip("bitsandbytes")
    rt = runtime(tmp_path, base_dir)
    t = task(1, adapter=adapter, method=method, steps=2, max_new_tokens=4, dp_noise_multiplier=1.0)

    reply = rt.train(message(t))

    metrics = reply.content.metric_records[TRAIN_METRICS]
    assert metrics["dp_noise_multiplier"] == 1.0 and metrics["dp_sample_rate"] == 8 / 40
    assert metrics["epsilon"] == pytest.approx(reference("rdp", [(1.0, 0.2, 2)]), rel=1e-6)
    assert rt.trainer is not None and rt.trainer.adapter == adapter


def test_a_client_limited_to_one_objective_stops_at_a_round_asking_for_another(
    tmp_path: Path, base_dir: Path
) -> None:
    rt = runtime(tmp_path, base_dir)
    rt.method = "sft"

    with pytest.raises(RoundRefusal, match=r"asks for grpo training and this client runs only sft"):
        rt.train(message(task(1, method="grpo")))

    assert rt.trainer is None and not (tmp_path / "models").exists()


def test_the_residual_is_kept_only_once_the_coordinator_holds_the_update(
    tmp_path: Path, base_dir: Path
) -> None:
    # `join` uploads after train(): a crash before the upload must not carry the residual twice
    rt = runtime(tmp_path, base_dir)
    rt.persist_feedback = False
    saved = tmp_path / "feedback.safetensors"

    rt.train(message(task(1, steps=2)))
    assert rt.feedback.residual and not saved.exists()
    rt.revert_feedback()  # refused: nothing was transmitted, nothing carries over
    assert rt.feedback.residual == {}

    rt.train(message(task(2, steps=2)))
    kept = {k: v.clone() for k, v in rt.feedback.residual.items()}
    rt.commit_feedback()  # accepted
    rt.revert_feedback()
    assert saved.exists() and rt.feedback.residual.keys() == kept.keys()
    assert all(torch.equal(rt.feedback.residual[k], kept[k]) for k in kept)
