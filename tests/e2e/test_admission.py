"""Admission against a real `gym-coordinator serve` with its default limits: registration floods
from one address and from many add a bounded number of ledger rows while honest contributors
still register, and `admission = "invite"` admits a new key only with a valid code; a fresh
identity sending huge updates under the default settings neither shapes the published model
beyond the robust rule's bound nor takes the reward pool."""

from __future__ import annotations

import sqlite3
import threading
import time
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from hostile_registration import SourceProxy, flood, register
from serve_process import ServeProcess, serve
from sqlmodel import Session

from zoo_gym.coordinator.config import CoordinatorConfig
from zoo_gym.coordinator.rounds import RoundSummary
from zoo_gym.coordinator.strategy import RoundAggregate, ZooStrategy
from zoo_gym.core.delta import Layout
from zoo_gym.core.identity import Identity
from zoo_gym.core.synthetic import make_examples, shard
from zoo_gym.ledger import (
    create_invite,
    list_audit,
    list_contributors,
    list_rewards,
    open_database,
    verify_ledger,
)
from zoo_gym.ledger.invites import invite_prefix
from zoo_gym.simulation.inprocess import InProcessFederation

pytestmark = pytest.mark.e2e

DEFAULTS = CoordinatorConfig.model_validate({})
PER_ADDRESS = DEFAULTS.registration_burst_per_address
OVERALL = DEFAULTS.registration_burst


def contributor_rows(served: ServeProcess) -> int:
    db = sqlite3.connect(served.home / "ledger.db")
    try:
        return int(db.execute("SELECT count(*) FROM contributors").fetchone()[0])
    finally:
        db.close()


def register_until_admitted(address: str, who: Identity, within_s: float) -> tuple[str, str]:
    """Register `who`, retrying while the coordinator asks to retry; the last answer."""
    deadline = time.monotonic() + within_s
    answer = register(address, who, "honest")
    while answer[0] == "RESOURCE_EXHAUSTED" and time.monotonic() < deadline:
        time.sleep(0.5)
        answer = register(address, who, "honest")
    return answer


def flood_from(addresses: list[str], count: int) -> Counter[str]:
    """`count` fresh keys from each address, all at once; the answers by status code."""
    totals: Counter[str] = Counter()
    lock = threading.Lock()

    def one(address: str) -> None:
        counted = flood(address, count)
        with lock:
            totals.update(counted)

    threads = [threading.Thread(target=one, args=(a,)) for a in addresses]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return totals


def test_registration_floods_add_a_bounded_number_of_keys(tiny_home: Path) -> None:
    with serve(tiny_home) as served:
        # Prepare: an honest contributor registered before the floods
        known = Identity.generate()
        assert register(served.address, known, "known") == ("OK", "active")
        started = time.monotonic()

        # Execute: 30 fresh keys from 127.0.0.1 as fast as one channel goes (each refusal is
        # answered after the default delay of 1 s)
        one = flood(served.address, 30)
        one_s = time.monotonic() - started
        again = register(served.address, known, "known")
        with SourceProxy("127.0.0.2", served.address) as other:
            newcomer = register(other.address, Identity.generate(), "newcomer")
        rows_after_one = contributor_rows(served)

        # then 12 other addresses x 8 fresh keys at once, while the known key re-registers
        proxies = [SourceProxy(f"127.0.0.{10 + i}", served.address) for i in range(12)]
        try:
            during: list[tuple[str, str]] = []
            rejoin = threading.Thread(
                target=lambda: during.append(register(served.address, known, "known"))
            )
            rejoin.start()
            many = flood_from([p.address for p in proxies], 8)
            rejoin.join(timeout=60)
        finally:
            for p in proxies:
                p.close()
        elapsed = time.monotonic() - started
        rows = contributor_rows(served)
        with SourceProxy("127.0.0.40", served.address) as fresh:
            late = register_until_admitted(fresh.address, Identity.generate(), 15.0)

    # Assert: one address got its own burst (and what refilled meanwhile), not more
    per_address = PER_ADDRESS + int(one_s * DEFAULTS.registration_rate_per_address_per_s) + 1
    assert one["OK"] <= per_address and one["RESOURCE_EXHAUSTED"] >= 30 - per_address, one
    assert one_s >= 0.9 * one["RESOURCE_EXHAUSTED"]  # each refusal waited the delay
    assert set(one) <= {"OK", "RESOURCE_EXHAUSTED"}
    assert rows_after_one == 1 + one["OK"] + 1
    # a known key re-registers at once, and a newcomer from another address is admitted
    assert again == ("OK", "active") and newcomer == ("OK", "active")
    # all addresses together got the overall burst (and its refill); refused keys wrote nothing
    overall = OVERALL + int(elapsed * DEFAULTS.registration_rate_per_s) + 1
    assert sum(many.values()) == 96 and set(many) <= {"OK", "RESOURCE_EXHAUSTED"}, many
    assert rows - 1 <= overall and rows == rows_after_one + many["OK"], (rows, many)
    assert during == [("OK", "active")]
    # once the flood is over, an honest newcomer gets in
    assert late == ("OK", "active")


def test_invite_admission_admits_with_a_code_only(tiny_home: Path) -> None:
    # Prepare: a one-use code issued in the ledger (the REST and CLI routes are tested elsewhere)
    engine = open_database(f"sqlite:///{tiny_home / 'ledger.db'}")
    with Session(engine) as session:
        code = create_invite(
            session, note="alice", max_uses=1, valid_for=timedelta(days=1), actor="op"
        ).code
    engine.dispose()

    with serve(tiny_home, admission="invite") as served:
        alice, mallory = Identity.generate(), Identity.generate()

        # Execute
        without = register(served.address, mallory, "mallory")
        forged = register(served.address, mallory, "mallory", invite=code[:-2] + "xx")
        admitted = register(served.address, alice, "alice", invite=code)
        known = register(served.address, alice, "alice")  # a known key needs no code again
        reused = register(served.address, mallory, "mallory", invite=code)
        health = httpx.get(f"{served.rest}/health", timeout=5)
        rows = contributor_rows(served)
        log = served.log

    # Assert: one line each, what was wrong and what to do; only alice has a row
    assert without[0] == "PERMISSION_DENIED" and "invitation only" in without[1]
    assert "--invite" in without[1]
    assert forged[0] == "PERMISSION_DENIED" and "not valid here" in forged[1]
    assert admitted == ("OK", "active") and known == ("OK", "active")
    assert reused[0] == "PERMISSION_DENIED" and "used up" in reused[1]
    assert rows == 1 and health.status_code == 200
    assert "Traceback" not in log
    # the code's issue and its one use, with the key it admitted, are in the verified log
    engine = open_database(f"sqlite:///{tiny_home / 'ledger.db'}")
    with Session(engine) as session:
        events = list_audit(session, target=f"invite:{invite_prefix(code)}")
        assert [e.action for e in events] == ["invite.create", "invite.use"]
        assert events[1].detail["contributor"] == alice.contributor_id
        signer = Identity.load(tiny_home / "coordinator.key")
        assert verify_ledger(session, public_key=signer.public_key).ok
    engine.dispose()


@pytest.mark.parametrize("intake_bound", ["default", "off"])
def test_a_fresh_sybil_neither_shapes_the_model_nor_takes_the_pool(
    tiny_home: Path, intake_bound: str
) -> None:
    # Prepare: default settings (median, trust ramp, reward pool); three honest contributors and
    # one fresh identity whose updates are N(0, 1e4^2) per coordinate; in-process for speed.
    # By default intake refuses such an update for its norm; with the bound off the median and
    # the trust ramp must hold on their own.
    shards = shard(make_examples(4 * 24, seed=7), 4)
    overrides: dict[str, object] = {"rounds": 2, "training": {"steps": 3}}
    if intake_bound == "off":
        overrides["max_update_norm"] = 0
    fed = InProcessFederation.build(
        tiny_home,
        shards,
        overrides=overrides,
        byzantine=[3],
        attack="gaussian",
        attack_params={"sigma": 1e4},
    )
    co = fed.coordinator
    assert (co.config.aggregator, co.config.admission) == ("median", "open")
    strategies: list[ZooStrategy] = []
    make = co.make_strategy

    results: list[RoundAggregate] = []

    def keep(layout: Callable[[], Layout]) -> ZooStrategy:
        strategy = make(layout)
        aggregate_round = strategy.aggregate_round

        def kept(server_round: int, replies: Any) -> RoundAggregate:
            results.append(aggregate_round(server_round, replies))
            return results[-1]

        strategy.aggregate_round = kept  # type: ignore[method-assign]
        strategies.append(strategy)
        return strategy

    co.make_strategy = keep  # type: ignore[method-assign]
    bounds: list[tuple[float, float]] = []

    def inspect(summary: RoundSummary) -> None:
        last = results[-1]
        assert last is not None and last.rows is not None
        rows = last.rows  # a BitDelta round's rows stay compressed: decode them here
        decoded = rows if isinstance(rows, torch.Tensor) else rows.columns(0, rows.d)
        honest = torch.stack(
            [r for r, cid in zip(decoded, last.row_contributors, strict=True) if cid not in sybils]
        )  # (3, d)
        vector = torch.cat([v.flatten() for _, v in sorted(last.update.items())])
        outside = torch.clamp(honest.min(0).values - vector, min=0) + torch.clamp(
            vector - honest.max(0).values, min=0
        )
        bounds.append((float(outside.max()), float(vector.abs().max())))

    sybils = set(fed.byzantine.values())

    # Execute
    summaries = fed.run(on_round=inspect)

    # Assert: both rounds published an improving model inside the honest updates' range
    assert [s.status for s in summaries] == ["published", "published"]
    assert summaries[-1].loss_after < summaries[0].loss_before
    assert all(outside <= 1e-6 and largest < 1.0 for outside, largest in bounds), bounds
    (sybil,) = sybils
    with Session(co.engine) as session:
        for number in (1, 2):
            rewards = {r.contributor_id: r for r in list_rewards(session, round_number=number)}
            if intake_bound == "off":
                assert rewards[sybil].amount == 0, rewards[sybil].reason
            else:  # refused at intake: no update to score, nothing paid
                assert sybil not in rewards or rewards[sybil].amount == 0
            assert sum(r.amount for r in rewards.values()) == co.config.rewards.pool
        reputation = {c.contributor_id: c.reputation for c in list_contributors(session)}
    assert reputation[sybil] == 0.0 and all(r > 0 for c, r in reputation.items() if c != sybil)
