"""Approving, banning and unbanning change the ledger and leave an audit trail; reports."""

from __future__ import annotations

from typing import TYPE_CHECKING

from zoo_gym import ledger
from zoo_gym.core.identity import Identity

if TYPE_CHECKING:
    from api_world import World


def audit_of(world: World, target: str) -> list[ledger.AuditEvent]:
    with world.session() as s:
        return ledger.list_audit(s, target=target)


def status_of(world: World, cid: str) -> tuple[str, str | None]:
    with world.session() as s:
        row = ledger.get_contributor(s, contributor_id=cid)
        assert row is not None
        return row.status, row.status_reason


def test_ban_then_unban_are_recorded_with_who_did_it(world: World) -> None:
    # Prepare
    bob = world.bob.contributor_id

    # Execute
    banned = world.client.post(
        f"/contributors/{bob}/ban", json={"reason": "sign flipping"}, headers=world.as_admin
    )
    unbanned = world.client.post(f"/contributors/{bob}/unban", json={}, headers=world.as_admin)

    # Assert
    assert banned.status_code == 200 and banned.json()["status"] == "banned"
    assert banned.json()["status_reason"] == "sign flipping"
    assert unbanned.status_code == 200 and unbanned.json()["status"] == "active"
    assert status_of(world, bob) == ("active", "unbanned")
    events = audit_of(world, bob)
    assert [e.detail["status"] for e in events] == ["banned", "active"]
    assert all(e.actor.startswith("apikey:ops/") for e in events)
    with world.session() as s:
        ledger.checkpoint(s, signer=world.co.signer)  # as the round loop does at a round's end
        assert ledger.verify_ledger(s, public_key=world.co.signer.public_key).ok


def test_ban_needs_a_reason_and_a_known_contributor(world: World) -> None:
    bob = world.bob.contributor_id
    no_reason = world.client.post(
        f"/contributors/{bob}/ban", json={"reason": ""}, headers=world.as_admin
    )
    unknown = world.client.post(
        "/contributors/" + "0" * 32 + "/ban", json={"reason": "x"}, headers=world.as_admin
    )
    assert no_reason.status_code == 422
    assert unknown.status_code == 404 and "no contributor" in unknown.json()["detail"]
    assert status_of(world, bob)[0] == "active"


def test_approve_a_pending_contributor(world: World) -> None:
    # Prepare
    carol = Identity.generate()
    with world.session() as s:
        ledger.register_contributor(
            s,
            contributor_id=carol.contributor_id,
            public_key=carol.public_key,
            name="carol",
            status="pending",
        )

    # Execute
    pending = world.client.get(
        "/contributors", params={"status": "pending"}, headers=world.as_viewer
    )
    approved = world.client.post(
        f"/contributors/{carol.contributor_id}/approve", headers=world.as_admin
    )
    again = world.client.post(
        f"/contributors/{carol.contributor_id}/approve", headers=world.as_admin
    )

    # Assert
    assert [c["name"] for c in pending.json()] == ["carol"]
    assert approved.status_code == 200 and approved.json()["status"] == "active"
    assert again.status_code == 200
    assert len(audit_of(world, carol.contributor_id)) == 1  # approving twice writes once


def test_conflicting_status_changes_are_refused(world: World) -> None:
    bob = world.bob.contributor_id
    not_banned = world.client.post(f"/contributors/{bob}/unban", headers=world.as_admin)
    world.client.post(f"/contributors/{bob}/ban", json={"reason": "spam"}, headers=world.as_admin)
    approve_banned = world.client.post(f"/contributors/{bob}/approve", headers=world.as_admin)
    assert not_banned.status_code == 409 and "not banned" in not_banned.json()["detail"]
    assert approve_banned.status_code == 409 and "unban" in approve_banned.json()["detail"]
    assert status_of(world, bob) == ("banned", "spam")


def test_report_per_round_with_totals(shared_world: World) -> None:
    w = shared_world
    alice = w.client.get(
        f"/contributors/{w.alice.contributor_id}/report", headers=w.as_viewer
    ).json()
    bob = w.client.get(f"/contributors/{w.bob.contributor_id}/report", headers=w.as_viewer).json()

    (row,) = alice["rounds"]
    assert (row["round"], row["round_status"], row["decision"]) == (1, "published", "accepted")
    assert (row["reason"], row["score"], row["quality"], row["reward"]) == (
        "fedavg: averaged",
        0.5,
        0.25,
        5.0,
    )
    assert alice["totals"] == {
        "rounds": 1,
        "submissions": 1,
        "accepted": 1,
        "rejected": 0,
        "selected": 1,
        "rewarded": 1,
        "reward": 5.0,
        "amount": "5.000000000",
        "epsilon": None,
        "epsilon_delta": None,
    }
    (row,) = bob["rounds"]
    assert (row["decision"], row["reward"], row["amount"]) == ("rejected", 0.0, "0.000000000")
    assert (row["reward_id"], row["log_index"], row["reputation_after"]) == (None, None, None)
    assert row["reason"] == "update envelope is invalid: bad magic"
    assert bob["totals"]["rejected"] == 1 and bob["totals"]["reward"] == 0.0


def test_rewards_per_round_and_contributor(shared_world: World) -> None:
    w = shared_world
    by_round = w.client.get("/rewards", params={"round": 1}, headers=w.as_viewer).json()
    by_bob = w.client.get(
        "/rewards", params={"contributor_id": w.bob.contributor_id}, headers=w.as_viewer
    ).json()
    own = w.client.get(
        f"/contributors/{w.alice.contributor_id}/rewards", headers=w.as_viewer
    ).json()
    assert [(r["contributor_id"], r["amount"]) for r in by_round] == [
        (w.alice.contributor_id, "5.000000000")
    ]  # exact decimals travel as strings
    assert by_bob == []
    assert own == by_round


def test_an_admin_issues_lists_and_revokes_invitations(world: World) -> None:
    # Execute
    issued = world.client.post(
        "/contributors/invites",
        json={"note": "lab B", "uses": 2, "valid_for_hours": 24},
        headers=world.as_admin,
    )
    prefix = issued.json()["prefix"]
    listed = world.client.get("/contributors/invites", headers=world.as_admin)
    revoked = world.client.post(f"/contributors/invites/{prefix}/revoke", headers=world.as_admin)
    usable = world.client.get("/contributors/invites?usable=true", headers=world.as_admin)
    again = world.client.post(f"/contributors/invites/{prefix}/revoke", headers=world.as_admin)

    # Assert: the code is in the answer to its issue only, never in a list
    assert issued.status_code == 201 and issued.json()["code"].startswith(f"zgi_{prefix}_")
    assert (issued.json()["uses"], issued.json()["max_uses"], issued.json()["note"]) == (
        0,
        2,
        "lab B",
    )
    assert listed.status_code == 200 and [i["prefix"] for i in listed.json()] == [prefix]
    assert "code" not in listed.json()[0] and "secret_sha256" not in listed.json()[0]
    assert revoked.status_code == 200 and revoked.json()["revoked_at"] is not None
    assert usable.json() == [] and again.status_code == 409
    events = audit_of(world, f"invite:{prefix}")
    assert [e.action for e in events] == ["invite.create", "invite.revoke"]
    assert all(e.actor.startswith("apikey:ops/") for e in events)


def test_invitations_are_for_admins_with_sane_terms(world: World) -> None:
    body = {"uses": 1}
    assert world.client.post("/contributors/invites", json=body).status_code == 401
    assert world.client.get("/contributors/invites").status_code == 401
    viewer = world.client.post("/contributors/invites", json=body, headers=world.as_viewer)
    assert viewer.status_code == 403
    too_many = {"uses": 0}
    too_long = {"valid_for_hours": 24 * 400}
    for bad in (too_many, too_long):
        answer = world.client.post("/contributors/invites", json=bad, headers=world.as_admin)
        assert answer.status_code == 422
    missing = world.client.post("/contributors/invites/ffffffff/revoke", headers=world.as_admin)
    assert missing.status_code == 404
