"""`gym-coordinator admin ...` against a live REST server on 127.0.0.1."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlmodel import Session

from zoo_gym import ledger

if TYPE_CHECKING:
    from cli_server import Served

from cli_server import free_port, gym


def run_json(served: Served, *args: str, token: str | None = None) -> Any:
    result = served.admin_cli(*args, "--format", "json", token=token)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_read_commands_print_json(served: Served) -> None:
    alice = served.alice.contributor_id
    viewer = served.viewer

    rounds = run_json(served, "rounds", "list", token=viewer)
    detail = run_json(served, "rounds", "show", "1", token=viewer)
    summary = run_json(served, "rounds", "summary", "1", token=viewer)
    contributors = run_json(served, "contributors", "list", token=viewer)
    shown = run_json(served, "contributors", "show", alice, token=viewer)
    policy = run_json(served, "policy", "show", token=viewer)
    models = run_json(served, "models", "list", token=viewer)
    rewards = run_json(served, "rewards", "--round", "1", token=viewer)
    report = run_json(served, "report", alice, token=viewer)
    entries = run_json(served, "ledger", "entries", "--limit", "3", token=viewer)

    assert [r["status"] for r in rounds] == ["published"]
    assert [s["decision"] for s in detail["submissions"]] == ["accepted"]
    assert summary["accepted"] == 1 and summary["rewards_total"] == 3.0
    assert [c["name"] for c in contributors] == ["alice"] and shown["status"] == "active"
    assert policy["current"]["aggregator"] == "median"
    assert [m["version"] for m in models] == ["v0000"]
    assert [(r["contributor_id"], r["amount"]) for r in rewards] == [(alice, "3.000000000")]
    assert report["totals"]["reward"] == 3.0 and report["rounds"][0]["decision"] == "accepted"
    assert [e["index"] for e in entries["entries"]] == [0, 1, 2]


def test_ledger_checkpoint_and_proofs_verify(served: Served) -> None:
    head = run_json(served, "ledger", "checkpoint", "--create")
    proof = run_json(served, "ledger", "proof", "1")
    served.admin_cli("contributors", "ban", served.alice.contributor_id, "--reason", "x")
    run_json(served, "ledger", "checkpoint", "--create")
    consistency = run_json(served, "ledger", "consistency", str(head["size"]))
    assert proof["verified"] and proof["root"] == head["root"]
    assert consistency["verified"] and consistency["old_root"] == head["root"]


def test_control_and_policy_commands_change_the_coordinator(served: Served) -> None:
    alice = served.alice.contributor_id

    banned = run_json(served, "contributors", "ban", alice, "--reason", "sign flipping")
    unbanned = run_json(served, "contributors", "unban", alice)
    paused = run_json(served, "rounds", "pause", "--reason", "upgrade")
    started = run_json(served, "rounds", "start")
    resumed = run_json(served, "rounds", "resume")
    policy = run_json(served, "policy", "set", "aggregator=trimmed_mean", "training.clip_norm=1.0")
    audit = run_json(served, "audit")

    assert banned["status"] == "banned" and unbanned["status"] == "active"
    assert paused["paused"] and started["start"] is not None and not resumed["paused"]
    assert (
        policy["pending"]["aggregator"] == "trimmed_mean"
        and policy["pending"]["training"]["clip_norm"] == 1.0
    )
    assert [e["action"] for e in audit][-6:] == [
        "contributor.status",
        "contributor.status",
        "rounds.pause",
        "rounds.start",
        "rounds.resume",
        "policy.update",
    ]
    with Session(served.co.engine) as s:
        assert ledger.verify_ledger(s, public_key=served.co.signer.public_key).ok


def test_model_download_checks_every_file(served: Served, tmp_path: Path) -> None:
    result = served.admin_cli("models", "download", "v0000", "--out", str(tmp_path))
    assert result.exit_code == 0, result.output
    manifest = json.loads((served.co.registry.root / "v0000" / "manifest.json").read_text())
    for name, entry in manifest["files"].items():
        assert (
            hashlib.sha256((tmp_path / "v0000" / name).read_bytes()).hexdigest() == entry["sha256"]
        )


def test_table_output_and_token_from_environment(served: Served) -> None:
    result = gym(
        "admin", "--url", served.url, "rounds", "list", env={"ZOO_GYM_TOKEN": served.viewer}
    )
    assert result.exit_code == 0, result.output
    assert "published" in result.stdout and "v0000" in result.stdout


def one_line_error(result: Any) -> str:
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    line: str = lines[0]
    assert line.startswith("error: ")
    return line


def test_user_errors_print_one_line(served: Served) -> None:
    no_token = gym("admin", "--url", served.url, "rounds", "list", env={"ZOO_GYM_TOKEN": ""})
    viewer_ban = served.admin_cli(
        "contributors", "ban", served.alice.contributor_id, "-r", "x", token=served.viewer
    )
    bad_policy = served.admin_cli("policy", "set", "aggregator=nope")
    bad_setting = served.admin_cli("policy", "set", "aggregator")
    missing = served.admin_cli("rounds", "show", "42")
    unreachable = gym(
        "admin", "--url", f"http://127.0.0.1:{free_port()}", "--token", "t", "rounds", "list"
    )

    assert "not authenticated" in one_line_error(no_token)
    assert "not allowed" in one_line_error(viewer_ban)
    assert "aggregator must be one of" in one_line_error(bad_policy)
    assert "KEY=VALUE" in one_line_error(bad_setting)
    assert "no round 42" in one_line_error(missing)
    assert "cannot reach the coordinator" in one_line_error(unreachable)


def test_invite_commands_issue_list_and_revoke_a_code(served: Served) -> None:
    issued = run_json(served, "contributors", "invite", "--note", "lab C", "--uses", "3")
    listed = run_json(served, "contributors", "invites")
    revoked = run_json(served, "contributors", "revoke-invite", issued["prefix"])
    usable = run_json(served, "contributors", "invites", "--usable")

    assert issued["code"].startswith(f"zgi_{issued['prefix']}_") and issued["max_uses"] == 3
    assert [i["note"] for i in listed] == ["lab C"] and "code" not in listed[0]
    assert revoked["revoked_at"] is not None and usable == []
    again = served.admin_cli("contributors", "revoke-invite", issued["prefix"])
    assert again.exit_code != 0 and "already revoked" in again.output
    assert "Traceback" not in again.output
