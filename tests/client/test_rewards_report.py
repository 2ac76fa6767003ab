"""`gym-client rewards`: a contributor's statement over real HTTP from a coordinator's REST API on
127.0.0.1 (real app, real SQLite ledger), in every format, and verified against the signed log."""

from __future__ import annotations

import csv
import io
import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path

import pytest
from sqlmodel import Session, select
from typer.testing import CliRunner, Result

from zoo_gym import ledger
from zoo_gym.cli.client import app
from zoo_gym.client.report import (
    ReportApi,
    RewardsError,
    RoundLine,
    Statement,
    connect,
    money,
    record_mismatch,
)
from zoo_gym.client.state import LocalState
from zoo_gym.coordinator.api.app import RestServer
from zoo_gym.coordinator.config import load_config
from zoo_gym.coordinator.serve import api_services
from zoo_gym.coordinator.service import Coordinator
from zoo_gym.core import merkle
from zoo_gym.core.hashing import canonical_json
from zoo_gym.core.identity import Identity
from zoo_gym.ledger import LogEntry
from zoo_gym.simulation.demo import free_port

ENV = {"COLUMNS": "220", "NO_COLOR": "1"}


@dataclass
class Network:
    home: Path  # the contributor's: client.toml, client.key, state/state.json
    co: Coordinator
    url: str
    alice: Identity
    bob: Identity

    def rewards(self, *args: str, home: Path | None = None, api: bool = True) -> Result:
        where = ["--api", self.url] if api else []
        argv = ["rewards", "--home", str(home or self.home), *where, *args]
        return CliRunner().invoke(app, argv, env=ENV)

    def session(self) -> Session:
        return Session(self.co.engine)


def contributor_home(path: Path, name: str) -> Identity:
    result = CliRunner().invoke(app, ["init", "--home", str(path), "--name", name])
    assert result.exit_code == 0, result.output
    return Identity.load(path / "client.key")


def pin(home: Path, co: Coordinator, key: bytes | None = None) -> None:
    (home / "state").mkdir(exist_ok=True)
    identity = Identity.load(home / "client.key")
    state = LocalState(home / "state" / "state.json", "127.0.0.1:1", "", identity.contributor_id)
    state.coordinator_key = (key or co.signer.public_key).hex()
    state.save()


def submit(
    s: Session, who: Identity, number: int, decision: str, reason: str, eps: float | None
) -> int:
    if ledger.get_round(s, number=number) is None:
        ledger.open_round(
            s, number=number, base_version="v0000", seed=number, aggregator="krum", codec="bd"
        )
    sub = ledger.record_submission(
        s,
        round_number=number,
        contributor_id=who.contributor_id,
        nonce=f"{who.contributor_id}-{number}",
        base_version="v0000",
        payload_sha256="ab" * 32,
        size_bytes=10,
        decision=decision,
        reason=reason,
        epsilon=eps,
    )
    assert sub.id is not None
    return sub.id


def aggregate(s: Session, sid: int, *, selected: bool, score: float) -> None:
    verdict = "selected" if selected else "not selected"
    ledger.record_aggregation(
        s,
        submission_id=sid,
        selected=selected,
        weight=float(selected),
        trimmed_share=0.0,
        score=score,
        reason=f"krum: {verdict}",
    )


def pay(
    s: Session, who: Identity, number: int, q: float, amount: str, rep: float, why: str = ""
) -> None:
    ledger.record_reward(
        s,
        round_number=number,
        contributor_id=who.contributor_id,
        quality=q,
        amount=amount,
        reputation_after=rep,
        reason=why,
    )


def populate(co: Coordinator, alice: Identity, bob: Identity) -> None:
    """Four rounds for alice (paid 5, rejected at intake, paid zero, paid 2.123456789), one for
    bob; every round published; a checkpoint signed over all of it."""
    with Session(co.engine) as s:
        for who, name in ((alice, "alice"), (bob, "bob")):
            ledger.register_contributor(
                s, contributor_id=who.contributor_id, public_key=who.public_key, name=name
            )
        aggregate(s, submit(s, alice, 1, "accepted", "ok", None), selected=True, score=0.5)
        aggregate(s, submit(s, bob, 1, "accepted", "ok", None), selected=True, score=0.6)
        pay(s, alice, 1, 0.25, "5", 0.25)
        pay(s, bob, 1, 0.125, "3", 0.125)
        submit(s, alice, 2, "rejected", "signature does not verify", 0.75)
        aggregate(s, submit(s, alice, 3, "accepted", "ok", 0.5), selected=False, score=12.5)
        pay(s, alice, 3, -0.125, "0", 0.2, "not selected by the aggregator")
        aggregate(s, submit(s, alice, 4, "accepted", "ok", 1.0), selected=True, score=1.5)
        pay(s, alice, 4, 0.375, "2.123456789", 0.3)
        for number in range(1, 5):
            ledger.close_round(s, number=number, status="published", metrics={})
        ledger.checkpoint(s, signer=co.signer)


def start(coordinator_home: Path, contributor: Path) -> tuple[Network, RestServer]:
    co = Coordinator(load_config(coordinator_home / "coordinator.toml"))
    alice = contributor_home(contributor, "alice")
    bob = Identity.generate()
    populate(co, alice, bob)
    pin(contributor, co)
    port = free_port()
    server = RestServer(api_services(co), f"127.0.0.1:{port}")
    server.start(wait_s=10)
    return Network(contributor, co, f"http://127.0.0.1:{port}", alice, bob), server


@pytest.fixture
def network(tiny_home: Path, tmp_path: Path) -> Iterator[Network]:
    """A network of one's own, to tamper with."""
    net, server = start(tiny_home, tmp_path / "alice")
    yield net
    server.stop()
    net.co.engine.dispose()


@pytest.fixture(scope="module")
def shared(tiny_home_template: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Network]:
    """One network for the read-only tests of this module."""
    root = tmp_path_factory.mktemp("rewards")
    shutil.copytree(tiny_home_template, root / "coordinator")
    net, server = start(root / "coordinator", root / "alice")
    yield net
    server.stop()
    net.co.engine.dispose()


def reward_entry(net: Network, number: int) -> LogEntry:
    """The log entry that recorded alice's reward of round `number`."""
    with net.session() as s:
        (reward,) = ledger.list_rewards(
            s, round_number=number, contributor_id=net.alice.contributor_id
        )
        for entry in s.exec(select(LogEntry).where(LogEntry.kind == "reward")):
            rows = json.loads(bytes(entry.record))["rows"]
            if any(r["table"] == "rewards" and r["key"] == reward.id for r in rows):
                s.expunge(entry)
                return entry
    raise AssertionError(f"no reward entry for round {number}")


def error_line(result: Result) -> str:
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: ")
    return line


# --- the statement ------------------------------------------------------------------------------


def test_table_states_every_round_with_totals(shared: Network) -> None:
    # Execute
    result = shared.rewards()

    # Assert
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "rewards of alice" in out
    assert "signature does not verify" in out  # intake's reason for the unpaid round 2
    assert "accepted, not selected" in out and "not selected by the aggregator" in out
    assert "2.123456789" in out and "5.00" in out
    assert "n/a" in out  # round 1 reported no epsilon
    total = next(line for line in out.splitlines() if "total" in line)
    assert "3 accepted, 1 rejected" in total and "7.123456789" in total and "2.25" in total
    assert "ledger" not in out  # no verification column without --verify


def test_json_for_programs(shared: Network) -> None:
    # Execute
    result = shared.rewards("--format", "json")

    # Assert
    assert result.exit_code == 0, result.output
    body = json.loads(result.stdout)
    assert body["contributor_id"] == shared.alice.contributor_id
    assert [r["amount"] for r in body["rounds"]] == [
        "5.000000000",
        "0.000000000",
        "0.000000000",
        "2.123456789",
    ]
    assert [r["epsilon"] for r in body["rounds"]] == [None, 0.75, 0.5, 1.0]
    assert body["totals"]["amount"] == "7.123456789" and body["totals"]["rewarded"] == 2
    assert "verification" not in body


def test_csv_has_a_row_per_round_then_totals(shared: Network) -> None:
    # Execute
    result = shared.rewards("--format", "csv")

    # Assert
    assert result.exit_code == 0, result.output
    rows = list(csv.DictReader(io.StringIO(result.stdout)))
    assert [r["round"] for r in rows] == ["1", "2", "3", "4", "total"]
    assert [r["reward"] for r in rows] == [
        "5.000000000",
        "0.000000000",
        "0.000000000",
        "2.123456789",
        "7.123456789",
    ]
    assert (rows[1]["decision"], rows[1]["reason"], rows[1]["epsilon"]) == (
        "rejected",
        "signature does not verify",
        "0.75",
    )
    assert rows[0]["epsilon"] == "" and rows[2]["quality"] == "-0.125"
    assert rows[3]["reputation_after"] == "0.3" and rows[4]["epsilon"] == "2.25"


def test_html_is_one_self_contained_page(shared: Network, tmp_path: Path) -> None:
    # Execute
    out = tmp_path / "statement.html"
    result = shared.rewards("--format", "html", "--out", str(out))

    # Assert
    assert result.exit_code == 0, result.output
    assert f"wrote {out}" in result.stdout
    page = out.read_text()
    assert page.startswith("<!DOCTYPE html>") and "<style>" in page and "<svg" in page
    assert "7.123456789" in page and "signature does not verify" in page
    for fetch in ("<script", "<link", "<img", 'src="http', "url(http", "@import"):
        assert fetch not in page


def test_html_goes_to_rewards_html_by_default(
    shared: Network, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    result = shared.rewards("--format", "html")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "rewards.html").read_text().count("<tr") == 6  # head, 4 rounds, totals


def test_rest_address_from_client_toml(shared: Network, tmp_path: Path) -> None:
    # Prepare
    home = tmp_path / "alice"
    shutil.copytree(shared.home, home)
    with (home / "client.toml").open("a") as fh:
        fh.write(f'api_url = "{shared.url}/"\n')

    # Execute
    result = shared.rewards("--format", "json", home=home, api=False)

    # Assert
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["totals"]["rounds"] == 4


# --- verification -------------------------------------------------------------------------------


def test_verify_marks_every_reward_against_the_signed_checkpoint(shared: Network) -> None:
    # Execute
    result = shared.rewards("--verify")

    # Assert
    assert result.exit_code == 0, result.output
    marks = [line.split("│")[-2].strip() for line in result.stdout.splitlines() if "│" in line]
    assert marks == ["✓", "–", "✓", "✓", "3/3"]  # rounds 1-4 (2: nothing paid), totals
    assert "3 reward(s) verified against the checkpoint of size" in result.stdout


def test_verify_in_json(shared: Network) -> None:
    result = shared.rewards("--format", "json", "--verify")
    assert result.exit_code == 0, result.output
    body = json.loads(result.stdout)
    assert [r["verified"] for r in body["rounds"]] == ["ok", "none", "ok", "ok"]
    assert body["verification"]["ok"] and body["verification"]["verified"] == 3
    assert "verified against" in result.stderr  # the summary stays off stdout


def test_verify_fails_on_a_reward_row_edited_after_the_fact(network: Network) -> None:
    # Prepare: the operator's database says round 4 paid 1000
    entry = reward_entry(network, 4)
    with network.co.engine.begin() as db:
        db.exec_driver_sql(
            "UPDATE rewards SET amount = 1000 WHERE round_number = 4 AND contributor_id = ?",
            (network.alice.contributor_id,),
        )

    # Execute
    plain = network.rewards()
    checked = network.rewards("--verify")

    # Assert
    assert plain.exit_code == 0 and "1000.00" in plain.stdout  # the report shows the edited row
    line = error_line(checked)
    assert line == (
        f"error: verification failed: ledger entry {entry.index} (round 4): "
        "the report pays 1000.000000000, the log 2.123456789"
    )
    round_four = next(x for x in checked.stdout.splitlines() if x.startswith("│     4"))
    assert round_four.split("│")[-2].strip() == "✗"


def rewrite_reward(net: Network, number: int, amount: str) -> None:
    """Alice's reward of round `number` says `amount` in its row and in its log entry, whose leaf
    hash is recomputed: the database agrees with itself, the checkpoints signed before do not."""
    entry = reward_entry(net, number)
    record = json.loads(bytes(entry.record))
    for row in record["rows"]:
        if row["table"] == "rewards":
            row["fields"]["amount"] = amount
    forged = canonical_json(record)
    with net.co.engine.begin() as db:
        db.exec_driver_sql(
            "UPDATE rewards SET amount = ? WHERE round_number = ? AND contributor_id = ?",
            (amount, number, net.alice.contributor_id),
        )
        db.exec_driver_sql(
            'UPDATE log_entries SET record = ?, leaf_hash = ? WHERE "index" = ?',
            (forged, merkle.leaf_hash(forged), entry.index),
        )


def test_verify_fails_when_the_log_was_rewritten_to_match(network: Network) -> None:
    # Prepare: row and log entry both say 1000, the leaf hash recomputed; the checkpoint was
    # signed before
    rewrite_reward(network, 4, "1000.000000000")

    # Execute
    result = network.rewards("--verify")

    # Assert: every proof now comes from the rewritten tree, so none reaches the signed root
    first = reward_entry(network, 1)
    line = error_line(result)
    assert line.startswith(f"error: verification failed: ledger entry {first.index} (round 1): ")
    assert "does not reach the signed root" in line
    marks = [x.split("│")[-2].strip() for x in result.stdout.splitlines() if "│" in x]
    assert marks == ["✗", "–", "✗", "✗", "0/3"]


def test_verify_fails_on_a_forged_checkpoint(network: Network) -> None:
    # Prepare: a newer checkpoint signed by some other key
    with network.session() as s:
        ledger.checkpoint(s, signer=Identity.generate())

    # Execute
    result = network.rewards("--verify", "--format", "json")

    # Assert
    line = error_line(result)
    assert "the latest checkpoint (size" in line and "does not verify" in line
    body = json.loads(result.stdout)
    assert [r["verified"] for r in body["rounds"]] == ["failed", "none", "failed", "failed"]
    assert not body["verification"]["ok"]


def test_verify_fails_against_another_pinned_coordinator_key(network: Network) -> None:
    pin(network.home, network.co, key=Identity.generate().public_key)
    line = error_line(network.rewards("--verify"))
    assert "signed by another key than the coordinator key pinned at join" in line


def test_rewards_after_the_checkpoint_are_pending(network: Network) -> None:
    # Prepare: round 5 is paid after the last checkpoint
    with network.session() as s:
        submit(s, network.alice, 5, "accepted", "ok", None)
        pay(s, network.alice, 5, 0.5, "1", 0.4)

    # Execute
    result = network.rewards("--verify")

    # Assert
    assert result.exit_code == 0, result.output
    round_five = next(x for x in result.stdout.splitlines() if x.startswith("│     5"))
    assert round_five.split("│")[-2].strip() == "…"
    assert "1 recorded after it cannot be checked yet" in result.stdout


# --- rollback and fork: the newest checkpoint verified is kept -----------------------------------


def kept_size(net: Network) -> int:
    state = LocalState.load(net.home / "state" / "state.json")
    return int(state.checkpoints[net.co.signer.public_key.hex()]["size"])


def log_size(net: Network) -> int:
    with net.session() as s:
        return ledger.log_size(s)


def pay_round_five(net: Network) -> None:
    """Round 5 pays alice and ends published, with the checkpoint the round loop signs."""
    with net.session() as s:
        submit(s, net.alice, 5, "accepted", "ok", None)
        pay(s, net.alice, 5, 0.5, "1", 0.4)
        ledger.close_round(s, number=5, status="published", metrics={})
        ledger.checkpoint(s, signer=net.co.signer)


def test_verify_keeps_the_checkpoint_and_requires_the_log_to_grow_from_it(
    network: Network,
) -> None:
    # Prepare
    first = network.rewards("--verify")
    size = kept_size(network)
    pay_round_five(network)

    # Execute
    second = network.rewards("--verify")

    # Assert
    assert first.exit_code == 0 and second.exit_code == 0, second.output
    assert f"the log extends the checkpoint of size {size} verified before" in second.stdout
    assert kept_size(network) == log_size(network) > size


def test_verify_fails_when_the_log_shrank(network: Network) -> None:
    # Prepare: alice verified the checkpoint of round 5; then it was deleted
    before = log_size(network)
    pay_round_five(network)
    assert network.rewards("--verify").exit_code == 0
    with network.co.engine.begin() as db:
        db.exec_driver_sql("DELETE FROM checkpoints WHERE id = (SELECT MAX(id) FROM checkpoints)")

    # Execute
    line = error_line(network.rewards("--verify"))

    # Assert
    assert line.startswith(
        f"error: verification failed: the log shrank: the coordinator's newest checkpoint has "
        f"size {before}, smaller than the checkpoint of size {log_size(network)} you verified"
    )
    assert kept_size(network) == log_size(network)  # the failed one is not kept


def test_verify_fails_when_the_log_forked_before_the_kept_checkpoint(network: Network) -> None:
    # Prepare: alice verified; round 4's reward is rewritten, and a later checkpoint signs it
    assert network.rewards("--verify").exit_code == 0
    size = kept_size(network)
    rewrite_reward(network, 4, "1000.000000000")
    pay_round_five(network)

    # Execute
    line = error_line(network.rewards("--verify"))

    # Assert
    assert line.startswith(
        f"error: verification failed: the log forked: its tree of size {size} now has root "
    )
    assert f"an entry before {size} was rewritten" in line


def test_verify_fails_when_a_rewritten_log_is_signed_again_at_the_same_size(
    network: Network,
) -> None:
    # Prepare: the finding: the newest checkpoint deleted, the log rewritten, signed again
    assert network.rewards("--verify").exit_code == 0
    size = kept_size(network)
    with network.co.engine.begin() as db:
        db.exec_driver_sql("DELETE FROM checkpoints")
    rewrite_reward(network, 4, "1000.000000000")
    with network.session() as s:
        ledger.checkpoint(s, signer=network.co.signer)

    # Execute
    line = error_line(network.rewards("--verify"))

    # Assert
    assert line.startswith(
        f"error: verification failed: the log forked: its checkpoint of size {size} has "
        f"another root than the checkpoint of size {size} you verified"
    )


def test_verify_fails_when_every_checkpoint_was_deleted(network: Network) -> None:
    assert network.rewards("--verify").exit_code == 0
    with network.co.engine.begin() as db:
        db.exec_driver_sql("DELETE FROM checkpoints")
    line = error_line(network.rewards("--verify"))
    assert "the coordinator serves no checkpoint, but you verified one of size" in line


def test_a_join_saving_its_state_keeps_the_newer_checkpoint(network: Network) -> None:
    # Prepare: a `join` process loaded the state before `rewards --verify` kept a checkpoint
    path = network.home / "state" / "state.json"
    running = LocalState.load(path)
    assert network.rewards("--verify").exit_code == 0

    # Execute
    running.save()

    # Assert
    assert kept_size(network) == log_size(network)


# --- what a user can get wrong ------------------------------------------------------------------


def test_errors_a_user_can_cause_are_one_line(shared: Network, tmp_path: Path) -> None:
    # Prepare
    stranger = tmp_path / "stranger"
    contributor_home(stranger, "stranger")  # a key the coordinator never registered
    keyless = tmp_path / "keyless"
    shutil.copytree(shared.home, keyless)
    (keyless / "client.key").unlink()
    stateless = tmp_path / "stateless"
    shutil.copytree(shared.home, stateless)
    shutil.rmtree(stateless / "state")
    closed = f"http://127.0.0.1:{free_port()}"
    misconfigured = tmp_path / "misconfigured"
    shutil.copytree(shared.home, misconfigured)
    with (misconfigured / "client.toml").open("a") as fh:
        fh.write('api_url = "127.0.0.1:8080"\n')

    # Execute / Assert
    cases = [
        (shared.rewards(api=False), "no REST address: pass --api"),
        (shared.rewards("--api", closed), "cannot reach the coordinator's REST API"),
        (shared.rewards("--api", "127.0.0.1:8080"), "must start with http:// or https://"),
        (shared.rewards(home=keyless), "no key at"),
        (shared.rewards(home=tmp_path / "nowhere"), "no client config at"),
        (shared.rewards("--verify", home=stateless), "no coordinator key is pinned"),
        (shared.rewards(home=stranger), "has this key joined the network"),
        (shared.rewards(home=misconfigured, api=False), "api_url must start with http://"),
    ]
    for result, expected in cases:
        assert expected in error_line(result)


def test_a_contributor_cannot_read_another_contributors_report(shared: Network) -> None:
    with connect(shared.url) as http:
        api = ReportApi(http, shared.alice)
        own = api.get(f"/contributors/{shared.alice.contributor_id}/report")
        with pytest.raises(RewardsError, match=r"refused access .* \(403"):
            api.get(f"/contributors/{shared.bob.contributor_id}/report")
        with pytest.raises(RewardsError, match="403"):
            api.get(f"/contributors/{shared.bob.contributor_id}/rewards/entries")
    assert own["totals"]["rounds"] == 4


# --- pieces -------------------------------------------------------------------------------------


def line(**changes: object) -> RoundLine:
    values: dict[str, object] = {
        "round": 4,
        "round_status": "published",
        "decision": "accepted",
        "reason": "ok",
        "reward_reason": "",
        "selected": True,
        "score": 1.5,
        "quality": 0.375,
        "amount": Decimal("2.5"),
        "reputation_after": 0.3,
        "epsilon": None,
        "reward_id": 7,
        "log_index": 12,
    }
    return RoundLine(**{**values, **changes})  # type: ignore[arg-type]


def record(amount: object, *, v: int = 2) -> bytes:
    fields = {
        "id": 7,
        "round_number": 4,
        "contributor_id": "c" * 32,
        "quality": 0.375,
        "amount": amount,
        "reputation_after": 0.3,
    }
    rows = [{"table": "rewards", "key": 7, "fields": fields}]
    return canonical_json({"v": v, "index": 12, "kind": "reward", "rows": rows})


def test_record_comparison() -> None:
    cid = "c" * 32
    assert record_mismatch(record("2.500000000"), line(), cid) is None
    assert record_mismatch(record(2.5, v=1), line(), cid) is None  # version 1: float amounts
    assert record_mismatch(record("0E-9"), line(amount=Decimal(0)), cid) is None
    assert "pays 3.000000000" in str(record_mismatch(record("2.5"), line(amount=Decimal(3)), cid))
    assert "quality" in str(record_mismatch(record("2.5"), line(quality=0.5), cid))
    assert "round_number" in str(record_mismatch(record("2.5"), line(round=5), cid))
    assert "contributor_id" in str(record_mismatch(record("2.5"), line(), "d" * 32))
    assert "not a reward entry" in str(record_mismatch(record("2.5"), line(log_index=13), cid))
    assert "does not hold reward 8" in str(record_mismatch(record("2.5"), line(reward_id=8), cid))


def test_amounts_for_people() -> None:
    assert [money(Decimal(x)) for x in ("5", "0E-9", "2.123456789", "0.10")] == [
        "5.00",
        "0.00",
        "2.123456789",
        "0.10",
    ]


def test_a_report_this_client_cannot_read_is_one_clear_error() -> None:
    with pytest.raises(RewardsError, match="not in a form this client reads"):
        Statement.from_json({"version": 9, "rounds": []})


def test_without_a_checkpoint_nothing_is_verified_yet(network: Network) -> None:
    with network.co.engine.begin() as db:
        db.exec_driver_sql("DELETE FROM checkpoints")
    result = network.rewards("--verify")
    assert result.exit_code == 0, result.output
    assert "has not signed a checkpoint yet: nothing could be verified" in result.stdout
    marks = [x.split("│")[-2].strip() for x in result.stdout.splitlines() if "│" in x]
    assert marks == ["…", "–", "…", "…", "0/3"]


def test_an_expired_token_is_renewed(shared: Network) -> None:
    with connect(shared.url) as http:
        api = ReportApi(http, shared.alice, token="zgc_" + "0" * 32 + "_1_" + "0" * 64)
        report = api.get(f"/contributors/{shared.alice.contributor_id}/report")
    assert report["name"] == "alice" and api.token.startswith("zgc_" + api.contributor_id)


def test_a_composed_epsilon_is_shown_with_its_delta() -> None:
    from zoo_gym.client.report.render import epsilon_text

    assert epsilon_text(3.14159, 1e-5) == "3.14 (δ=1e-05)"
    assert epsilon_text(2.25) == "2.25"  # a sum of rounds holds for no single delta
    assert epsilon_text(None, 1e-5) == "n/a"
