"""The contributor report: per-round numbers, exact amounts, totals, and the log entries behind
each reward, readable by the contributor itself and by operators, by no one else."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import pytest
from api_world import sign_in

from zoo_gym import ledger
from zoo_gym.coordinator.api.auth import challenge_statement
from zoo_gym.core import merkle
from zoo_gym.core.protocol import rest_challenge_statement

if TYPE_CHECKING:
    from api_world import World


def submit(
    world: World,
    number: int,
    *,
    decision: str,
    reason: str,
    eps: float | None,
    dp: ledger.DpMechanism | None = None,
) -> int:
    with world.session() as s:
        if ledger.get_round(s, number=number) is None:
            ledger.open_round(
                s, number=number, base_version="v0000", seed=number, aggregator="krum", codec="bd"
            )
        sub = ledger.record_submission(
            s,
            round_number=number,
            contributor_id=world.alice.contributor_id,
            nonce=f"alice-{number}-{decision}",
            base_version="v0000",
            payload_sha256="cd" * 32,
            size_bytes=10,
            decision=decision,
            reason=reason,
            epsilon=eps,
            dp=dp,
        )
        assert sub.id is not None
        return sub.id


def record_rounds(world: World) -> None:
    """Alice after round 1 (accepted, 5.0): round 2 rejected at intake, round 3 accepted but not
    selected (paid zero), round 4 accepted and paid an amount with all nine places."""
    cid = world.alice.contributor_id
    submit(world, 2, decision="rejected", reason="signature does not verify", eps=0.75)
    three = submit(world, 3, decision="accepted", reason="accepted at intake", eps=0.5)
    four = submit(world, 4, decision="accepted", reason="accepted at intake", eps=1.0)
    with world.session() as s:
        for sid, selected, score in ((three, False, 12.5), (four, True, 1.5)):
            ledger.record_aggregation(
                s,
                submission_id=sid,
                selected=selected,
                weight=float(selected),
                trimmed_share=0.0,
                score=score,
                reason=f"krum: {'selected' if selected else 'not selected'}",
            )
        for number, quality, amount, reputation, why in (
            (3, -0.125, "0", 0.2, "not selected by the aggregator"),
            (4, 0.375, "2.123456789", 0.3, ""),
        ):
            ledger.record_reward(
                s,
                round_number=number,
                contributor_id=cid,
                quality=quality,
                amount=amount,
                reputation_after=reputation,
                reason=why,
            )


def report(world: World, headers: dict[str, str], cid: str | None = None) -> Any:
    cid = cid or world.alice.contributor_id
    response = world.client.get(f"/contributors/{cid}/report", headers=headers)
    assert response.status_code == 200, response.text
    return response.json()


def test_report_states_every_round_with_exact_amounts_and_totals(world: World) -> None:
    # Prepare
    record_rounds(world)

    # Execute
    body = report(world, world.auth(sign_in(world.client, world.alice)))

    # Assert
    rows = {r["round"]: r for r in body["rounds"]}
    assert body["version"] == 2 and body["reputation"] == 0.3
    assert [(r["decision"], r["amount"], r["quality"]) for r in rows.values()] == [
        ("accepted", "5.000000000", 0.25),
        ("rejected", "0.000000000", None),
        ("accepted", "0.000000000", -0.125),
        ("accepted", "2.123456789", 0.375),
    ]
    assert rows[2]["reason"] == "signature does not verify"  # intake's reason, no reward row
    assert (rows[2]["reward_id"], rows[2]["log_index"], rows[2]["epsilon"]) == (None, None, 0.75)
    assert (rows[3]["reason"], rows[3]["reward_reason"]) == (
        "krum: not selected",
        "not selected by the aggregator",
    )
    assert [r["reputation_after"] for r in rows.values()] == [0.25, None, 0.2, 0.3]
    assert rows[1]["epsilon"] is None and rows[4]["epsilon"] == 1.0
    totals = body["totals"]
    assert totals["amount"] == "7.123456789" and totals["reward"] == pytest.approx(7.123456789)
    assert (totals["rounds"], totals["accepted"], totals["rejected"]) == (4, 3, 1)
    assert (totals["selected"], totals["rewarded"]) == (2, 2)
    assert totals["epsilon"] == pytest.approx(2.25)  # no round stated its mechanism: a sum
    assert totals["epsilon_delta"] is None


def test_total_epsilon_composes_the_stated_mechanisms(world: World) -> None:
    # Prepare: three DP-SGD rounds, two with the same mechanism; the second names a larger delta
    from opacus.accountants import RDPAccountant

    from zoo_gym.privacy.accounting import epsilon

    mechanisms = [
        ledger.DpMechanism(1.1, 0.05, 40, 1e-5, "rdp"),
        ledger.DpMechanism(0.9, 0.1, 20, 1e-4, "prv"),
        ledger.DpMechanism(1.1, 0.05, 40, 1e-5, "rdp"),
    ]
    claimed = [epsilon(m.noise_multiplier, m.sample_rate, m.steps, m.delta) for m in mechanisms]
    for number, (m, eps) in enumerate(zip(mechanisms, claimed, strict=True), start=2):
        submit(world, number, decision="accepted", reason="accepted at intake", eps=eps, dp=m)

    # Execute
    headers = world.auth(sign_in(world.client, world.alice))
    totals = report(world, headers)["totals"]

    # Assert: Opacus's RDP accountant over the same history, at the smallest delta; under the sum
    direct = RDPAccountant()
    direct.history = [(m.noise_multiplier, m.sample_rate, m.steps) for m in mechanisms]
    assert totals["epsilon_delta"] == 1e-5
    assert totals["epsilon"] == pytest.approx(direct.get_epsilon(delta=1e-5), rel=1e-9)
    assert totals["epsilon"] < sum(claimed)
    with world.session() as s:
        [row] = ledger.list_submissions(
            s, round_number=3, contributor_id=world.alice.contributor_id
        )
    assert row.dp_mechanism == mechanisms[1]


def test_each_reward_names_the_log_entry_that_recorded_it(world: World) -> None:
    # Prepare
    record_rounds(world)
    token = world.auth(sign_in(world.client, world.alice))

    # Execute
    rows = [r for r in report(world, token)["rounds"] if r["reward_id"] is not None]
    served = world.client.get(
        f"/contributors/{world.alice.contributor_id}/rewards/entries", headers=token
    )

    # Assert
    assert served.status_code == 200, served.text
    entries = {e["index"]: e for e in served.json()}
    assert sorted(entries) == [r["log_index"] for r in rows]
    for row in rows:
        entry = entries[row["log_index"]]
        record = json.loads(entry["record"])
        (reward,) = [r for r in record["rows"] if r["table"] == "rewards"]
        assert (entry["kind"], reward["key"]) == ("reward", row["reward_id"])
        assert reward["fields"]["amount"] in (row["amount"], "0E-9")  # zero: the ledger's form
        assert merkle.leaf_hash(entry["record"].encode()).hex() == entry["leaf_hash"]


def test_operators_get_the_same_report(world: World) -> None:
    record_rounds(world)
    own = report(world, world.auth(sign_in(world.client, world.alice)))
    assert report(world, world.as_viewer) == own
    assert report(world, world.as_admin) == own


def test_a_contributor_reads_neither_the_report_nor_the_entries_of_another(world: World) -> None:
    # Prepare
    record_rounds(world)
    bob = world.auth(sign_in(world.client, world.bob))
    alice = world.alice.contributor_id

    # Execute
    their_report = world.client.get(f"/contributors/{alice}/report", headers=bob)
    their_entries = world.client.get(f"/contributors/{alice}/rewards/entries", headers=bob)
    all_entries = world.client.get("/ledger/entries", headers=bob)
    own_entries = world.client.get(
        f"/contributors/{world.bob.contributor_id}/rewards/entries", headers=bob
    )

    # Assert
    assert their_report.status_code == 403 and "another contributor" in their_report.text
    assert their_entries.status_code == 403
    assert all_entries.status_code == 403
    assert own_entries.status_code == 200 and own_entries.json() == []  # bob was never paid


def test_a_contributor_may_read_checkpoints_and_inclusion_proofs(world: World) -> None:
    # Prepare
    record_rounds(world)
    with world.session() as s:
        head = ledger.checkpoint(s, signer=world.co.signer)
    token = world.auth(sign_in(world.client, world.alice))
    index = report(world, token)["rounds"][-1]["log_index"]

    # Execute
    checkpoint = world.client.get("/ledger/checkpoint", headers=token)
    proof = world.client.get(
        "/ledger/proofs/inclusion", params={"index": index, "tree_size": head.size}, headers=token
    )

    # Assert
    assert checkpoint.status_code == 200 and checkpoint.json()["root"] == head.root
    assert proof.status_code == 200 and proof.json()["root"] == head.root


def test_report_schema_documents_exact_amounts_and_log_indices(world: World) -> None:
    schema = world.client.get("/openapi.json", headers=world.as_viewer).json()
    schemas = schema["components"]["schemas"]
    row = schemas["ReportRow"]["properties"]
    assert row["amount"]["type"] == "string"
    assert {"decision", "reason", "score", "quality", "reputation_after", "epsilon"} <= set(row)
    assert "log_index" in row and "amount" in schemas["ReportTotals"]["properties"]


def test_rest_challenge_statement_bytes_are_pinned() -> None:
    cid = "0123456789abcdef" * 2
    expected = f"zoo-gym/rest-auth/v1|{cid}|n0nce|1700000000000".encode()
    assert rest_challenge_statement(cid, "n0nce", 1_700_000_000_000) == expected
    assert challenge_statement(cid, "n0nce", 1_700_000_000_000) == expected
