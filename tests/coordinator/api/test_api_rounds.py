"""Round history from the ledger and the operator's controls over the round loop."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from zoo_gym import ledger

if TYPE_CHECKING:
    from api_world import World


def test_round_detail_and_summary(shared_world: World) -> None:
    w = shared_world
    (listed,) = w.client.get("/rounds", headers=w.as_viewer).json()
    detail = w.client.get("/rounds/1", headers=w.as_viewer).json()
    summary = w.client.get("/rounds/1/summary", headers=w.as_viewer).json()
    missing = w.client.get("/rounds/7", headers=w.as_viewer)

    assert listed["number"] == 1 and listed["status"] == "published"
    decisions = {s["contributor_id"]: (s["decision"], s["selected"]) for s in detail["submissions"]}
    assert decisions == {
        w.alice.contributor_id: ("accepted", True),
        w.bob.contributor_id: ("rejected", None),
    }
    assert [r["amount"] for r in detail["rewards"]] == ["5.000000000"]
    assert (summary["received"], summary["accepted"], summary["rejected"], summary["selected"]) == (
        2,
        1,
        1,
        1,
    )
    assert summary["rejected_by_reason"] == {"update envelope is invalid: bad magic": 1}
    assert summary["rewards_total"] == 5.0 and summary["rewarded"] == 1
    assert missing.status_code == 404


def test_pause_start_resume_drive_the_loop(world: World) -> None:
    # Prepare: a round loop waiting between rounds
    c, control = world.client, world.control
    stop, ran = threading.Event(), threading.Event()

    def loop() -> None:
        while control.wait_until_runnable(stop, poll_s=0.01):
            ran.set()
            while ran.is_set() and not stop.is_set():
                stop.wait(0.01)

    # Execute / Assert: paused, the loop waits; a start lets exactly one round through
    paused = c.post("/rounds/pause", json={"reason": "maintenance"}, headers=world.as_admin).json()
    assert paused["paused"] and paused["pause"]["reason"] == "maintenance"
    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    assert not ran.wait(0.2)
    assert c.post("/rounds/start", headers=world.as_admin).status_code == 202
    assert ran.wait(5)
    ran.clear()
    assert not ran.wait(0.2)  # the pause holds again

    resumed = c.post("/rounds/resume", headers=world.as_admin)
    again = c.post("/rounds/resume", headers=world.as_admin)
    assert resumed.status_code == 200 and not resumed.json()["paused"]
    assert again.status_code == 409
    assert ran.wait(5)
    stop.set()
    thread.join(5)
    assert not thread.is_alive()
    with world.session() as s:
        actions = [e.action for e in ledger.list_audit(s, target="rounds")]
    assert actions == ["rounds.pause", "rounds.start", "rounds.resume"]


def test_abort_only_an_open_round(world: World) -> None:
    # Prepare
    with world.session() as s:
        ledger.open_round(
            s, number=2, base_version="v0000", seed=2, aggregator="fedavg", codec="bitdelta"
        )

    # Execute
    closed = world.client.post("/rounds/1/abort", json={"reason": "late"}, headers=world.as_admin)
    unknown = world.client.post("/rounds/9/abort", json={"reason": "late"}, headers=world.as_admin)
    no_reason = world.client.post("/rounds/2/abort", json={"reason": ""}, headers=world.as_admin)
    aborted = world.client.post(
        "/rounds/2/abort", json={"reason": "bad data"}, headers=world.as_admin
    )

    # Assert
    assert closed.status_code == 409 and "already published" in closed.json()["detail"]
    assert unknown.status_code == 404 and no_reason.status_code == 422
    assert aborted.status_code == 202 and "2" in aborted.json()["aborts"]
    request = world.control.abort_requested(2)
    assert (
        request is not None
        and request.reason == "bad data"
        and request.by.startswith("apikey:ops/")
    )
    with world.session() as s:
        (event,) = ledger.list_audit(s, target="round:2")
    assert event.action == "round.abort" and event.detail == {"reason": "bad data"}
    state = world.client.get("/rounds/control", headers=world.as_viewer).json()
    assert state["aborts"]["2"]["reason"] == "bad data"


def test_round_numbers_beyond_the_ledgers_range_are_refused(shared_world: World) -> None:
    # a round filter past the ledger's 64-bit columns reached SQLite and failed there (a 500)
    w = shared_world
    alice = w.alice.contributor_id
    paths = [
        "/rounds/9223372036854775808",
        "/rewards?round=9223372036854775808",
        "/rewards?round=-1",
        f"/contributors/{alice}/submissions?round=9223372036854775808",
        f"/contributors/{alice}/rewards?round=9223372036854775808",
        f"/contributors/{alice}/report?round=9223372036854775808",
    ]

    answers = {p: w.client.get(p, headers=w.as_viewer) for p in paths}
    largest = w.client.get("/rewards?round=9223372036854775807", headers=w.as_viewer)

    assert {p: a.status_code for p, a in answers.items()} == dict.fromkeys(paths, 422)
    assert largest.status_code == 200 and largest.json() == []
