"""The ServerApp and ClientApps of deployment, run in-process on the loopback Grid."""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path

import pytest
import torch
from flwr.app import Message, RecordDict
from sqlmodel import Session

from zoo_gym import ledger
from zoo_gym.coordinator.rounds import RoundSummary
from zoo_gym.core.synthetic import make_examples, shard
from zoo_gym.simulation.inprocess import InProcessFederation


@pytest.mark.parametrize("aggregator", ["fedavg", "trimmed_mean"])
def test_loopback_federation_improves_and_records(tiny_home: Path, aggregator: str) -> None:
    # Prepare
    shards = shard(make_examples(3 * 60, seed=1), 3)
    overrides = {"rounds": 2, "min_clients": 3, "aggregator": aggregator, "byzantine_f": 1}
    fed = InProcessFederation.build(tiny_home, shards, overrides=overrides)

    # Execute
    summaries = fed.run()

    # Assert
    assert [s.status for s in summaries] == ["published", "published"]
    assert [s.accepted for s in summaries] == [3, 3]
    assert summaries[-1].loss_after < summaries[0].loss_before
    assert summaries[1].base_version == summaries[0].published_version == "v0001"
    with Session(fed.coordinator.engine) as session:
        subs = ledger.list_submissions(session)
        assert len(subs) == 6
        assert all(s.decision == "accepted" for s in subs)
        assert {s.round_number for s in subs} == {1, 2}
        versions = [v.version for v in ledger.list_model_versions(session)]
        assert versions[-2:] == ["v0001", "v0002"]
    assert all(r.base_version == "v0001" for r in fed.runtimes.values())


def test_multikrum_round_leaves_out_the_attacker_and_records_why(tiny_home: Path) -> None:
    # Prepare: 5 clients, client 0 sends 5 x the negated honest mean; Multi-Krum tolerates f = 1
    shards = shard(make_examples(5 * 24, seed=2), 5)
    overrides = {
        "rounds": 1,
        "min_clients": 5,
        "aggregator": "multikrum",
        "byzantine_f": 1,
        "training": {"steps": 3},
    }
    fed = InProcessFederation.build(
        tiny_home,
        shards,
        overrides=overrides,
        byzantine=[0],
        attack="sign_flip",
        attack_params={"scale": 5.0},
    )

    # Execute
    (summary,) = fed.run()

    # Assert: all five passed intake; the rule selected the four honest updates only
    assert (summary.status, summary.accepted, summary.aggregated) == ("published", 5, 4)
    (attacker,) = fed.byzantine.values()
    with Session(fed.coordinator.engine) as session:
        subs = {s.contributor_id: s for s in ledger.list_submissions(session)}
    assert subs[attacker].selected is False and "score" in (subs[attacker].aggregation_reason or "")
    assert all(s.selected for cid, s in subs.items() if cid != attacker)
    assert summary.loss_after < summary.loss_before

    # every scored contribution has a reward row; the attacker's is zero, with the rule's reason
    with Session(fed.coordinator.engine) as session:
        rewards = {r.contributor_id: r for r in ledger.list_rewards(session, round_number=1)}
        reputations = {c.contributor_id: c.reputation for c in ledger.list_contributors(session)}
    assert set(rewards) == set(subs)
    assert rewards[attacker].amount == 0
    assert rewards[attacker].reason.startswith(
        "not used by multikrum: not among the 4 lowest Krum scores"
    )
    assert sum(r.amount for r in rewards.values()) == Decimal(100)  # exact: the whole pool
    paid = [r for cid, r in rewards.items() if cid != attacker and r.amount > 0]
    assert paid and all(r.quality is not None and r.quality > 0 for r in paid)
    # shares follow quality: amount_i / amount_j == quality_i / quality_j (to the micro-unit)
    a, b = paid[0], paid[-1]
    assert float(a.amount) * float(b.quality) == pytest.approx(
        float(b.amount) * float(a.quality), rel=1e-4
    )
    assert reputations[attacker] == 0.0 and all(
        reputations[cid] > 0 for cid in rewards if rewards[cid].amount > 0
    )


def test_round_with_fewer_updates_than_the_rule_needs_is_aborted(tiny_home: Path) -> None:
    # Prepare: krum with f = 1 needs 5 updates; two of the five replies are dropped on the way
    shards = shard(make_examples(5 * 24, seed=2), 5)
    overrides = {
        "rounds": 1,
        "min_clients": 5,
        "quorum": 1,
        "aggregator": "krum",
        "byzantine_f": 1,
        "training": {"steps": 2},
    }
    dropped: list[int] = []

    def drop_two(node: int, reply: Message) -> Message:
        if len(dropped) < 2:
            dropped.append(node)
            return Message(RecordDict(), reply_to=reply)  # answers no request: lost on the way
        return reply

    fed = InProcessFederation.build(tiny_home, shards, overrides=overrides, tamper=drop_two)

    # Execute
    (summary,) = fed.run()

    # Assert: aborted, the base stays, the three usable updates say why they were not used
    assert summary.status == "aborted" and summary.published_version == ""
    with Session(fed.coordinator.engine) as session:
        used = [s for s in ledger.list_submissions(session) if s.decision == "accepted"]
    assert len(used) == 3
    assert all(
        s.aggregation_reason == "round aborted: 3 usable updates, krum needs 5" for s in used
    )


def test_operator_abort_and_staged_policy_reach_the_round_loop(tiny_home: Path) -> None:
    # Prepare: round 1 is aborted by an operator; a policy change switches round 2 to the median
    from zoo_gym.coordinator.control import PolicyChange

    shards = shard(make_examples(3 * 24, seed=3), 3)
    fed = InProcessFederation.build(
        tiny_home,
        shards,
        overrides={
            "rounds": 2,
            "min_clients": 3,
            "aggregator": "fedavg",
            "training": {"steps": 2},
        },
    )
    co = fed.coordinator
    co.control.request_abort(1, by="admin:ops", reason="suspicious data")
    staged = co.config.model_copy(update={"aggregator": "median", "byzantine_f": 1})
    statuses: list[str] = []

    def after(summary: RoundSummary) -> None:
        statuses.append(summary.status)
        if len(statuses) == 1:
            co.control.stage_policy(
                PolicyChange(staged, {"aggregator": ("fedavg", "median")}, by="admin:ops")
            )

    # Execute
    fed.run(on_round=after)

    # Assert: round 1 aborted with who and why; round 2 ran under the staged rule
    assert statuses == ["aborted", "published"]
    with Session(co.engine) as session:
        first, second = ledger.get_round(session, number=1), ledger.get_round(session, number=2)
        assert first is not None and second is not None
        assert (first.metrics or {})["aborted_by"] == "admin:ops"
        assert (first.metrics or {})["reason"] == "suspicious data"
        assert "median" in (
            ledger.list_submissions(session, round_number=2)[0].aggregation_reason or ""
        )
    assert co.config.aggregator == "median"
    exposed = co.metrics.exposition().decode()
    assert 'zoo_gym_rounds_total{status="aborted"} 1.0' in exposed
    assert 'zoo_gym_rounds_total{status="published"} 1.0' in exposed
    assert "zoo_gym_submissions_accepted_total 6.0" in exposed


def test_fused_fedavg_publishes_what_the_row_by_row_path_publishes(
    tiny_home_template: Path, tmp_path: Path
) -> None:
    # Prepare: the same round twice; without scoring nothing needs one row per update, so FedAvg
    # sums the envelopes in one fused pass (decode_accumulate)
    import shutil

    from zoo_gym.core.weights import load_weights

    shards = shard(make_examples(2 * 40, seed=5), 2)
    common = {
        "rounds": 1,
        "min_clients": 2,
        "aggregator": "fedavg",
        "quality_gate_tolerance": 100.0,
    }
    published = {}
    weights = {}
    for method in ("none", "individual"):
        home = tmp_path / method
        shutil.copytree(tiny_home_template, home)
        rewards = {"method": method}
        fed = InProcessFederation.build(home, shards, overrides={**common, "rewards": rewards})
        assert fed.coordinator.make_strategy(lambda: {}).keep_rows is (method != "none")

        # Execute
        [summary] = fed.run()

        # Assert
        assert summary.status == "published"
        published[method] = load_weights(home / "models" / "v0001")
        with Session(fed.coordinator.engine) as session:
            weights[method] = sorted((s.weight or 0.0) for s in ledger.list_submissions(session))
    for name, tensor in published["none"].items():
        assert torch.allclose(tensor, published["individual"][name], atol=1e-6), name
    assert weights["none"] == pytest.approx([0.5, 0.5])
    assert weights["individual"] == pytest.approx([0.5, 0.5])


def test_a_sharded_base_trains_and_publishes_sharded_versions(sharded_home: Path) -> None:
    # Prepare: v0000 is a Hugging Face index and shards; shard_size = 100 kB in coordinator.toml
    from typing import Any

    from transformers import AutoModelForCausalLM

    from zoo_gym.coordinator.registry import Published
    from zoo_gym.core.manifest import read_verified
    from zoo_gym.core.weights import INDEX, WEIGHTS, load_weights, shard_files

    shards = shard(make_examples(2 * 24, seed=6), 2)
    overrides = {
        "rounds": 2,
        "min_clients": 2,
        "aggregator": "fedavg",
        "quality_gate_tolerance": 100.0,
        "training": {"steps": 2},
    }
    fed = InProcessFederation.build(sharded_home, shards, overrides=overrides)
    co = fed.coordinator
    merged: dict[str, dict[str, torch.Tensor]] = {}
    publish = co.registry.publish

    def recorded(state_dict: dict[str, torch.Tensor], **kwargs: Any) -> Published:
        published = publish(state_dict, **kwargs)
        merged[published.version] = {k: v.clone() for k, v in state_dict.items()}
        return published

    co.registry.publish = recorded  # type: ignore[method-assign]

    # Execute
    summaries = fed.run()

    # Assert: both rounds published; round 2 trained on v0001, read from its shards
    assert [s.status for s in summaries] == ["published", "published"]
    assert [s.accepted for s in summaries] == [2, 2]
    assert all(r.base_version == "v0001" for r in fed.runtimes.values())
    for version in ("v0001", "v0002"):
        directory = co.registry.root / version
        assert len(shard_files(directory)) > 3 and (directory / INDEX).exists()
        assert not (directory / WEIGHTS).exists()
        manifest = read_verified(directory, co.signer.public_key)
        assert {INDEX, *(p.name for p in shard_files(directory))} <= set(manifest.files)
        loaded = load_weights(directory)
        assert loaded.keys() == merged[version].keys()
        assert all(torch.equal(loaded[k], v) for k, v in merged[version].items())
    for runtime in fed.runtimes.values():
        read_verified(runtime.home / "models" / "v0001", co.signer.public_key)
    model = AutoModelForCausalLM.from_pretrained(co.registry.root / "v0002", dtype=torch.float32)
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in merged["v0002"].items())
