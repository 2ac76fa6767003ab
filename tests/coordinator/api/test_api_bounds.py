"""What one request may carry: bodies bounded before parsing (413), malformed paths answered 404,
and error bodies that never repeat the input nor show a traceback."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest
from fastapi.testclient import TestClient

from zoo_gym.coordinator.api.limits import MAX_DETAIL_CHARS

if TYPE_CHECKING:
    from api_world import World

LIMIT = 64 << 10  # the default api_max_body_bytes
MARK = "ZZMARKZZ"


def test_a_declared_body_over_the_limit_is_413_before_it_is_read(shared_world: World) -> None:
    body = b"{" + b" " * LIMIT + b"}"
    response = shared_world.client.post(
        "/auth/token", content=body, headers={"content-type": "application/json"}
    )

    assert response.status_code == 413
    assert response.json() == {
        "detail": f"the request body is larger than {LIMIT} bytes, "
        "the most this API accepts; send a smaller one"
    }
    assert response.headers["connection"] == "close"


def test_a_chunked_body_is_counted_and_cut_off(shared_world: World) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"contributor_id": "'
        for _ in range(40):
            yield b"a" * 4096

    response = shared_world.client.post(
        "/auth/challenge", content=chunks(), headers={"content-type": "application/json"}
    )

    assert response.status_code == 413


def test_a_body_within_the_limit_still_reaches_the_route(shared_world: World) -> None:
    w = shared_world
    response = w.client.post(
        "/auth/challenge", json={"contributor_id": w.alice.contributor_id, "pad": " " * 60_000}
    )
    assert response.status_code == 200


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/auth/token", {"contributor_id": MARK * 6000, "nonce": MARK, "signature": MARK}),
        ("/auth/challenge", {"contributor_id": [MARK] * 5000}),
        ("/auth/challenge", {MARK * 1000: 1}),
    ],
    ids=["long-string", "many-items", "long-key"],
)
def test_validation_errors_name_fields_and_rules_never_the_input(
    shared_world: World, path: str, body: object
) -> None:
    response = shared_world.client.post(path, json=body)

    assert response.status_code == 422
    assert MARK not in response.text
    assert len(response.content) < 4096
    for error in response.json()["detail"]:
        assert set(error) == {"loc", "msg", "type"}


def test_broken_and_deeply_nested_json_are_refused_without_echo(shared_world: World) -> None:
    w = shared_world
    broken = w.client.post(
        "/auth/challenge",
        content=b'{"contributor_id": "' + MARK.encode() * 100,
        headers={"content-type": "application/json"},
    )
    deep = w.client.patch(
        "/policy",
        content=b"[" * 50_000 + b"]" * 50_000,
        headers={**w.as_admin, "content-type": "application/json"},
    )

    assert broken.status_code == 422 and MARK not in broken.text
    assert 400 <= deep.status_code < 500 and len(deep.content) < 4096


@pytest.mark.parametrize(
    "path",
    [
        "/models/v0000/files/config%00.json",
        "/models/v0000%00/manifest",
        "/contributors/%00",
        "/models/v0000/files/%zz%ff",
        "/models/v0000/files/..%2F..%2Fcoordinator.toml",
        "/models/v0000/files/" + "a" * 5000,
        "/models/%2e%2e/manifest",
    ],
    ids=["nul-name", "nul-version", "nul-id", "bad-percent", "traversal", "overlong", "dotdot"],
)
def test_malformed_paths_are_404(shared_world: World, path: str) -> None:
    response = shared_world.client.get(path, headers=shared_world.as_viewer)

    assert response.status_code == 404, response.text
    assert len(response.json()["detail"]) <= MAX_DETAIL_CHARS


def test_an_unexpected_error_is_one_line_without_traceback(
    shared_world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken() -> list[str]:
        raise RuntimeError("secret internals at /srv/coordinator")

    monkeypatch.setattr(shared_world.co.registry, "versions", broken)
    client = TestClient(shared_world.app, raise_server_exceptions=False)
    response = client.get("/models", headers=shared_world.as_viewer)

    assert response.status_code == 500
    assert response.json() == {
        "detail": "the coordinator failed on this request; its log has the details"
    }
