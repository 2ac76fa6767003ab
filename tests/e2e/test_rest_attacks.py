"""Attacks on the REST API of a real `gym-coordinator serve` with its DEFAULT limits.

Each finding is reproduced and shown refused while an admin with a right key and a signed-in
contributor, from the attacker's own address, are still answered:
- oversized bodies (declared and chunked) and an oversized head: refused before parsing, and the
  coordinator's memory does not grow with them;
- validation errors do not repeat the input;
- malformed paths (NUL, bad percent-encoding, traversal, overlong) are 404, never 500;
- a flood of bad tokens is answered 429 past its budget and locks nobody out;
- `/openapi.json` needs a viewer key, `/docs` is off;
- clients that trickle a head or a body are cut off at the read deadline (slow).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from hostile_rest import (
    bad_token_flood,
    client,
    long_head,
    malformed_paths,
    oversized_body,
    trickle,
)
from serve_process import ServeProcess, serve
from sqlmodel import Session

from zoo_gym import ledger
from zoo_gym.core.identity import Identity
from zoo_gym.core.protocol import rest_challenge_statement

MIB = 1 << 20


@dataclass
class Operators:
    served: ServeProcess
    admin: str
    viewer: str
    alice: Identity

    def as_(self, token: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {token}"}


@pytest.fixture(scope="module")
def operators(
    tmp_path_factory: pytest.TempPathFactory, tiny_home_template: Path
) -> Iterator[Operators]:
    import shutil

    from zoo_gym.coordinator.config import load_config

    home = tmp_path_factory.mktemp("rest_attacks") / "coordinator"
    shutil.copytree(tiny_home_template, home)
    engine = ledger.open_database(load_config(home / "coordinator.toml").ledger_url)
    alice = Identity.generate()
    with Session(engine) as s:
        admin = ledger.create_api_key(s, name="ops", role="admin", actor="test").token
        viewer = ledger.create_api_key(s, name="dash", role="viewer", actor="test").token
        ledger.register_contributor(
            s, contributor_id=alice.contributor_id, public_key=alice.public_key, name="alice"
        )
    engine.dispose()
    with serve(home) as served:
        yield Operators(served, admin, viewer, alice)


def contributor_token(rest: str, who: Identity, *, source: str = "127.0.0.1") -> str:
    cid = who.contributor_id
    with client(rest, source=source) as http:
        issued = http.post("/auth/challenge", json={"contributor_id": cid}).json()
        statement = rest_challenge_statement(cid, issued["nonce"], issued["expires_at_ms"])
        answer = {"contributor_id": cid, "nonce": issued["nonce"]}
        response = http.post("/auth/token", json={**answer, "signature": who.sign(statement).hex()})
    assert response.status_code == 200, response.text
    token: str = response.json()["access_token"]
    return token


def honest_calls_work(ops: Operators, contributor: str, *, source: str = "127.0.0.1") -> None:
    """The admin and the contributor, from the attacker's address, are answered."""
    with client(ops.served.rest, source=source) as http:
        assert http.get("/rounds", headers=ops.as_(ops.admin)).status_code == 200
        own = http.get(f"/contributors/{ops.alice.contributor_id}", headers=ops.as_(contributor))
        assert own.status_code == 200, own.text


def test_oversized_bodies_and_heads_are_refused_and_memory_stays_flat(
    operators: Operators,
) -> None:
    ops, served = operators, operators.served
    contributor = contributor_token(served.rest, ops.alice)
    # warm up every path once, so first-use allocations are not counted as growth
    oversized_body(served.rest, size=MIB)
    oversized_body(served.rest, size=MIB, chunked=True)
    long_head(served.rest, size=MIB)
    before = served.rss_kib(), served.rss_kib("VmHWM")

    attacks = [
        {"chunked": chunked, "path": path}
        for chunked in (False, True)
        for path in ("/auth/token", "/auth/challenge")
    ] * 3
    attacks.append({"chunked": True, "path": "/policy", "method": "PATCH", "token": ops.admin})
    with ThreadPoolExecutor(8) as pool:  # 13 bodies of 64 MiB, 8 at a time
        sent = [pool.submit(oversized_body, served.rest, size=64 * MIB, **a) for a in attacks]
        heads = [pool.submit(long_head, served.rest, size=64 * MIB) for _ in range(3)]
        answers = [f.result() for f in sent]
        head_answers = [f.result() for f in heads]
    after = served.rss_kib(), served.rss_kib("VmHWM")

    assert [a.status for a in answers] == [413] * len(attacks), answers
    assert all(a.headers.get("connection") == "close" for a in answers)
    assert b"larger than 65536 bytes" in answers[0].body
    assert [a.status for a in head_answers] == [400] * 3
    growth_mib = (after[0] - before[0]) / 1024
    peak_growth_mib = (after[1] - before[1]) / 1024
    print(f"\nRSS {before[0] / 1024:.0f} -> {after[0] / 1024:.0f} MiB, peak +{peak_growth_mib:.1f}")
    assert growth_mib < 24 and peak_growth_mib < 24  # one such body grew it by 320 MiB before
    honest_calls_work(ops, contributor)


def test_validation_errors_do_not_repeat_the_input(operators: Operators) -> None:
    mark = "ZZMARKZZ" * 7000  # 56 KiB, under the body limit
    with client(operators.served.rest) as http:
        response = http.post(
            "/auth/token", json={"contributor_id": mark, "nonce": "n", "signature": "00"}
        )
    assert response.status_code == 422
    assert len(response.content) < 2048 and "ZZMARKZZ" not in response.text


def test_malformed_paths_are_404_without_traceback(operators: Operators) -> None:
    served = operators.served
    statuses = malformed_paths(served.rest, token=operators.viewer)

    assert set(statuses.values()) == {404}, statuses
    assert "Traceback" not in served.log


def test_a_bad_token_flood_is_answered_429_and_locks_nobody_out(operators: Operators) -> None:
    ops, rest = operators, operators.served.rest
    contributor = contributor_token(rest, ops.alice)
    admin_prefix = ops.admin.split("_")[1]

    began = time.monotonic()
    flood = bad_token_flood(rest, count=14, source="127.0.0.6")
    flood_s = time.monotonic() - began
    aimed = bad_token_flood(rest, count=12, source="127.0.0.2", named=admin_prefix)
    honest_calls_work(ops, contributor, source="127.0.0.6")
    elsewhere = bad_token_flood(rest, count=1, source="127.0.0.3")
    with client(rest, source="127.0.0.6") as http:
        refused = http.get("/rounds", headers=ops.as_("zgk_00000000_nope"))

    assert flood == {401: 10, 429: 4}  # the default budget: 10 failures per 300 s
    assert flood_s >= 4 * 0.9  # past it, each refusal waited the default delay of 1 s
    assert aimed == {401: 10, 429: 2}
    assert elsewhere == {401: 1}  # another address has its own budget
    assert refused.status_code == 429 and int(refused.headers["retry-after"]) <= 30
    assert "failed credentials past their budget" in ops.served.log  # operators see it
    # a contributor can still sign in from the flooding address
    assert contributor_token(rest, ops.alice)


def test_honest_callers_are_answered_while_their_address_floods(operators: Operators) -> None:
    ops, rest, source = operators, operators.served.rest, "127.0.0.5"
    contributor = contributor_token(rest, ops.alice, source=source)
    with ThreadPoolExecutor(4) as pool:
        floods = [pool.submit(bad_token_flood, rest, count=6, source=source) for _ in range(4)]
        for _ in range(5):
            honest_calls_work(ops, contributor, source=source)
        answered = sum((f.result() for f in floods), Counter[int]())

    assert set(answered) == {401, 429} and answered[401] <= 11  # 10, one more per 30 s


def test_the_schema_needs_a_viewer_key_and_docs_are_off(operators: Operators) -> None:
    with client(operators.served.rest, source="127.0.0.7") as http:  # an address with no failures
        anonymous = http.get("/openapi.json")
        docs, redoc = http.get("/docs"), http.get("/redoc")
        viewer = http.get("/openapi.json", headers=operators.as_(operators.viewer))

    assert anonymous.status_code == 401
    assert docs.status_code == redoc.status_code == 404
    assert "/rounds" in viewer.json()["paths"]


@pytest.mark.slow
def test_trickling_clients_are_cut_off_at_the_default_deadline(operators: Operators) -> None:
    ops, rest = operators, operators.served.rest
    contributor = contributor_token(rest, ops.alice)
    with ThreadPoolExecutor(20) as pool:
        heads = [pool.submit(trickle, rest, every_s=1.0) for _ in range(10)]
        bodies = [pool.submit(trickle, rest, body=True, every_s=1.0) for _ in range(10)]
        honest_calls_work(ops, contributor)
        cut = [f.result() for f in heads + bodies]

    assert all(9 < took < 20 for took, _ in cut), [took for took, _ in cut]  # default 10 s
    assert [a.status for _, a in cut] == [None] * 10 + [408] * 10


def test_health_stays_open(operators: Operators) -> None:
    assert httpx.get(f"{operators.served.rest}/health", timeout=10).status_code == 200
