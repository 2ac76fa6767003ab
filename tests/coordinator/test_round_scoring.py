"""Scoring on the coordinator: candidates merged on the evaluator's device, one backward pass for
first_order, the round's validation subset, the time budget, and the cost in the round summary."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from sqlmodel import Session

from zoo_gym import ledger
from zoo_gym.coordinator.config import CoordinatorConfig, TrainingPolicy, load_config
from zoo_gym.coordinator.evaluation import Evaluator
from zoo_gym.coordinator.payout import RoundScorer
from zoo_gym.coordinator.rounds import lora_spec, update_layout
from zoo_gym.coordinator.service import Coordinator
from zoo_gym.coordinator.strategy import resolve_device
from zoo_gym.core.delta import numel, unflatten
from zoo_gym.core.lora import for_base, linear_layers_of, merge_update
from zoo_gym.core.synthetic import make_examples, shard
from zoo_gym.core.weights import load_weights
from zoo_gym.scoring import validation_subset
from zoo_gym.simulation.inprocess import InProcessFederation

SEED = 1234  # the round's frozen-A seed
CARRY_SEED = 777  # the previous epoch's, for carried Bs
SUBSET_SEED = 99


@pytest.fixture(scope="module")
def base(tiny_home_template: Path) -> Path:
    return tiny_home_template / "models" / "v0000"


@pytest.fixture(scope="module")
def evaluator(tiny_home_template: Path, base: Path) -> Evaluator:
    return Evaluator(base, tiny_home_template / "validation.jsonl")


def _scorer(
    evaluator: Evaluator,
    base: Path,
    *,
    adapter: str = "ffa_lora",
    examples: int = 256,
    baseline: float | None = None,
) -> RoundScorer:
    training = TrainingPolicy.model_validate({"adapter": adapter.removesuffix("+carry")})
    state = load_weights(base)
    spec = for_base(lora_spec(training), linear_layers_of(base), adapter=training.adapter)
    layout = update_layout(state, spec, training.adapter, carry=adapter.endswith("+carry"))
    return RoundScorer(
        evaluator,
        training,
        state,
        layout,
        spec,
        seed=SEED,
        carry_seed=CARRY_SEED if adapter.endswith("+carry") else None,
        subset_seed=SUBSET_SEED,
        examples=examples,
        baseline=baseline,
    )


def _direction(scorer: RoundScorer, norm: float, seed: int = 0) -> torch.Tensor:
    v = torch.randn(numel(scorer.layout), generator=torch.Generator().manual_seed(seed))
    return v * (norm / v.norm())


# "ffa_lora+carry": the first round of an epoch of A, each module's B and its carried B
ADAPTERS = ["ffa_lora", "ffa_lora+carry", "lora"]


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_candidate_utility_is_minus_the_loss_of_the_merged_model(
    evaluator: Evaluator, base: Path, adapter: str
) -> None:
    # the candidate merged into the model on its device equals merge_update of the state dict
    scorer = _scorer(evaluator, base, adapter=adapter)
    vector = _direction(scorer, 2.0)
    merged = {k: v.clone() for k, v in scorer.state.items()}
    merge_update(
        merged,
        unflatten(vector, scorer.layout),
        adapter=scorer.training.adapter,
        spec=scorer.spec,
        seed=SEED,
        carry_seed=scorer.carry_seed,
    )

    fast = scorer.utility(vector)
    reference = -evaluator.loss(merged)
    again = scorer.utility(vector)  # the model held a whole other state meanwhile

    assert fast == pytest.approx(reference, abs=1e-6)
    assert again == pytest.approx(fast, abs=1e-7)
    assert scorer.utility(torch.zeros(numel(scorer.layout))) == pytest.approx(
        -evaluator.loss(scorer.state), abs=1e-7
    )


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_gradient_predicts_a_small_step_of_the_validation_loss(
    evaluator: Evaluator, base: Path, adapter: str
) -> None:
    # U(eps v) - U(0) ~ eps grad U(0) . v: the backward pass, its mapping to B and the merge agree
    scorer = _scorer(evaluator, base, adapter=adapter)
    g = scorer.gradient()
    v = g / g.norm() * 1e-3 + _direction(scorer, 1e-3, seed=1)  # small, yet well above noise

    predicted = float(g.double() @ v.double())
    measured = scorer.utility(v) - scorer.utility(torch.zeros_like(v))

    assert g.shape == (numel(scorer.layout),) and g.device == evaluator.device
    assert abs(measured) > 1e-3
    assert predicted == pytest.approx(measured, rel=0.02)


def test_loss_gradient_leaves_the_model_as_it_was(evaluator: Evaluator, base: Path) -> None:
    state = load_weights(base)
    flags = {name: p.requires_grad for name, p in evaluator.model.named_parameters()}

    loss, grads = evaluator.loss_gradient(state, ["model.layers.0.self_attn.q_proj.weight"])

    assert loss == pytest.approx(evaluator.loss(state), rel=1e-5)
    assert set(grads) == {"model.layers.0.self_attn.q_proj.weight"}
    assert grads["model.layers.0.self_attn.q_proj.weight"].abs().sum() > 0
    assert {n: p.requires_grad for n, p in evaluator.model.named_parameters()} == flags
    assert all(p.grad is None for p in evaluator.model.parameters())
    with pytest.raises(ValueError, match=r"loss_gradient: nope\.weight is not a weight"):
        evaluator.loss_gradient(state, ["nope.weight"])


def test_a_subset_scores_on_the_records_drawn_from_the_round_seed(
    evaluator: Evaluator, base: Path
) -> None:
    assert len(evaluator.prompts) == 200
    everything = _scorer(evaluator, base, examples=256, baseline=-1.0)
    sampled = _scorer(evaluator, base, examples=50, baseline=-1.0)
    indices = validation_subset(len(evaluator.records), 50, seed=SUBSET_SEED)

    assert len(evaluator.records) == 200  # the tiny home's validation set
    assert everything.evaluator is evaluator and everything.baseline == -1.0
    assert sampled.evaluator.records == [evaluator.records[i] for i in indices]
    assert sampled.evaluator.model is evaluator.model  # one model in memory
    assert sampled.baseline is None  # U(0) on the whole set is not U(0) on the sample
    assert len(evaluator.prompts) == 200  # cached on the whole set before the subset was taken
    assert [p for p, _ in sampled.evaluator.prompts] == [
        p for i, (p, _) in enumerate(evaluator.prompts) if i in set(indices)
    ]  # GRPO's reward is computed on the subset's prompts
    zero = torch.zeros(numel(sampled.layout))
    assert sampled.utility(zero) != pytest.approx(everything.utility(zero), abs=1e-6)


def test_the_coordinator_evaluates_on_its_device(tiny_home: Path) -> None:
    config = load_config(tiny_home / "coordinator.toml")
    pinned = CoordinatorConfig.model_validate({**config.model_dump(), "device": "cpu"})

    auto = Coordinator(config)
    cpu = Coordinator(pinned)

    expected = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    assert config.device == "auto" and resolve_device("auto") == expected
    assert auto.evaluator.device == expected
    assert {p.device.type for p in auto.evaluator.model.parameters()} == {expected.type}
    assert cpu.evaluator.device == torch.device("cpu")
    assert {p.device.type for p in cpu.evaluator.model.parameters()} == {"cpu"}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_scoring_on_cuda_matches_the_cpu(
    tiny_home_template: Path, base: Path, evaluator: Evaluator
) -> None:
    on_gpu = Evaluator(base, tiny_home_template / "validation.jsonl", device="cuda")
    cpu, gpu = _scorer(evaluator, base), _scorer(on_gpu, base)
    vector = _direction(cpu, 2.0)

    assert gpu.utility(vector) == pytest.approx(cpu.utility(vector), abs=1e-4)
    g_cpu, g_gpu = cpu.gradient(), gpu.gradient()
    assert g_gpu.device.type == "cuda"
    assert torch.allclose(g_gpu.cpu(), g_cpu, rtol=1e-3, atol=1e-6)
    reward_functions = ["exact_answer"]
    state = load_weights(base)
    assert on_gpu.mean_reward(
        state, reward_functions=reward_functions, max_new_tokens=4
    ) == evaluator.mean_reward(state, reward_functions=reward_functions, max_new_tokens=4)


def _federation(home: Path, rewards: dict[str, object]) -> InProcessFederation:
    shards = shard(make_examples(3 * 24, seed=3), 3)
    overrides = {
        "rounds": 1,
        "min_clients": 3,
        "aggregator": "fedavg",
        "quality_gate_tolerance": 100.0,
        "training": {"steps": 2},
        "rewards": rewards,
    }
    return InProcessFederation.build(home, shards, overrides=overrides)


def test_round_summary_reports_what_scoring_cost(tiny_home_template: Path, tmp_path: Path) -> None:
    # Prepare: one round scored by individual, one by first_order
    summaries = {}
    exposed = {}
    for method in ("individual", "first_order"):
        home = tmp_path / method
        shutil.copytree(tiny_home_template, home)
        fed = _federation(home, {"method": method})

        # Execute
        [summaries[method]] = fed.run()
        exposed[method] = fed.coordinator.metrics.exposition().decode()

    # Assert: 200 validation records < scoring_examples, so U(0) is known: n evaluations
    individual, first = summaries["individual"], summaries["first_order"]
    assert (individual.scoring_method, individual.scoring_fallback_from) == ("individual", "")
    assert (individual.scoring_evaluations, individual.scoring_backward_passes) == (3, 0)
    assert (first.scoring_method, first.scoring_evaluations, first.scoring_backward_passes) == (
        "first_order",
        0,
        1,
    )
    assert 0 < first.scoring_seconds < individual.scoring_seconds + 60
    assert "zoo_gym_scoring_evaluations_total 3.0" in exposed["individual"]
    assert "zoo_gym_scoring_backward_passes_total 1.0" in exposed["first_order"]
    line = json.loads((tmp_path / "first_order" / "rounds.jsonl").read_text().splitlines()[-1])
    assert line["scoring_method"] == "first_order" and line["scoring_backward_passes"] == 1


def test_a_round_out_of_scoring_time_is_scored_by_first_order(tiny_home: Path) -> None:
    # Prepare: a budget no evaluation fits in
    fed = _federation(tiny_home, {"method": "individual", "scoring_seconds": 1e-9})

    # Execute
    [summary] = fed.run()

    # Assert: the round still publishes and pays; the summary, ledger and metrics say why
    assert summary.status == "published"
    assert summary.scoring_method == "first_order"
    assert summary.scoring_fallback_from == "individual"
    assert (summary.scoring_evaluations, summary.scoring_backward_passes) == (0, 1)
    with Session(fed.coordinator.engine) as session:
        rewards = ledger.list_rewards(session, round_number=1)
        closing = ledger.get_round(session, number=1)
    assert len(rewards) == 3 and all(r.quality is not None for r in rewards)
    assert closing is not None and (closing.metrics or {})["scoring_fallback_from"] == "individual"
    assert "zoo_gym_scoring_fallbacks_total 1.0" in fed.coordinator.metrics.exposition().decode()


@pytest.mark.parametrize(
    ("family", "adapter"),
    [("gpt2", "ffa_lora"), ("gpt2", "lora"), ("qwen2_tied", "full")],
)
def test_other_families_score_as_their_merged_model(
    tmp_path: Path, family: str, adapter: str
) -> None:
    # GPT-2 stores its Conv1D weights (in, out); a tied embedding is one weight updated once
    from families import save_family

    from zoo_gym.core.synthetic import write_jsonl
    from zoo_gym.core.tiny import task_tokenizer

    base = save_family(family, tmp_path / family, task_tokenizer())
    write_jsonl(make_examples(16, seed=99), tmp_path / "validation.jsonl")
    evaluator = Evaluator(base, tmp_path / "validation.jsonl")
    training = TrainingPolicy.model_validate({"adapter": adapter, "lora_rank": 4})
    state = load_weights(base)
    spec = for_base(lora_spec(training), linear_layers_of(base), adapter=adapter)
    layout = update_layout(state, spec, adapter)
    scorer = RoundScorer(
        evaluator,
        training,
        state,
        layout,
        spec,
        seed=SEED,
        subset_seed=0,
        examples=256,
        baseline=None,
    )
    vector = _direction(scorer, 1.0)
    merged = {k: v.clone() for k, v in state.items()}
    merge_update(merged, unflatten(vector, layout), adapter=adapter, spec=spec, seed=SEED)
    g = scorer.gradient()
    step = g / g.norm() * 3e-3

    assert scorer.utility(vector) == pytest.approx(-evaluator.loss(merged), abs=1e-6)
    measured = scorer.utility(step) - scorer.utility(torch.zeros_like(step))
    assert abs(measured) > 1e-3  # well above the float32 noise of the loss
    assert float(g.double() @ step.double()) == pytest.approx(measured, rel=0.05)
