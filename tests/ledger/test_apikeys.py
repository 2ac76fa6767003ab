"""API keys: only a hash is stored, tokens check in constant time, issue and revoke are audited."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import pytest
from sqlmodel import Session

from zoo_gym.ledger import (
    LedgerError,
    NotFound,
    authenticate_api_key,
    create_api_key,
    ledger_stats,
    list_api_keys,
    list_audit,
    list_entries,
    revoke_api_key,
    verify_ledger,
)
from zoo_gym.ledger.apikeys import hash_token, token_prefix

if TYPE_CHECKING:
    from conftest import Populated


def test_token_is_shown_once_and_stored_as_a_hash(session: Session) -> None:
    # Execute
    issued = create_api_key(session, name="alice", role="admin", actor="op")

    # Assert
    (row,) = list_api_keys(session)
    assert issued.token.startswith(f"zgk_{row.prefix}_") and len(issued.token) > 40
    assert row.secret_sha256 == hash_token(issued.token) and issued.token not in row.secret_sha256
    assert token_prefix(issued.token) == row.prefix
    found = authenticate_api_key(session, token=issued.token)
    assert found is not None and (found.name, found.role) == ("alice", "admin")


@pytest.mark.parametrize(
    "mangle",
    [
        lambda t: t[:-1] + ("A" if t[-1] != "A" else "B"),  # wrong secret
        lambda t: "zgk_ffffffff_" + t.split("_", 2)[2],  # unknown prefix
        lambda t: t.replace("zgk_", "zgx_"),
        lambda t: "",
        lambda t: "zgk__",
    ],
    ids=["wrong-secret", "unknown-prefix", "scheme", "empty", "no-parts"],
)
def test_other_tokens_are_refused(session: Session, mangle: object) -> None:
    token = create_api_key(session, name="viewer", role="viewer", actor="op").token
    assert authenticate_api_key(session, token=mangle(token)) is None  # type: ignore[operator]


def test_revoke_by_prefix_or_name(session: Session) -> None:
    # Prepare
    first = create_api_key(session, name="grafana", role="viewer", actor="op")
    second = create_api_key(session, name="ci", role="admin", actor="op")

    # Execute
    revoked = revoke_api_key(session, key=first.key.prefix, actor="op")
    by_name = revoke_api_key(session, key="ci", actor="op")

    # Assert
    assert revoked.revoked_at is not None and by_name.revoked_at is not None
    assert authenticate_api_key(session, token=first.token) is None
    assert authenticate_api_key(session, token=second.token) is None
    assert list_api_keys(session, include_revoked=False) == []
    with pytest.raises(LedgerError, match="already revoked"):
        revoke_api_key(session, key=first.key.prefix, actor="op")
    with pytest.raises(NotFound):
        revoke_api_key(session, key="nobody", actor="op")


def test_ambiguous_name_and_bad_input_are_refused(session: Session) -> None:
    create_api_key(session, name="bot", role="viewer", actor="op")
    create_api_key(session, name="bot", role="viewer", actor="op")
    with pytest.raises(LedgerError, match="revoke by prefix"):
        revoke_api_key(session, key="bot", actor="op")
    with pytest.raises(LedgerError, match="role"):
        create_api_key(session, name="x", role="root", actor="op")
    with pytest.raises(LedgerError, match="name"):
        create_api_key(session, name="  ", role="viewer", actor="op")


def test_issue_and_revoke_are_in_the_log_without_the_hash(
    session: Session, populated: Populated
) -> None:
    # Execute
    issued = create_api_key(session, name="ops", role="admin", actor="cli:root@host")
    revoke_api_key(session, key="ops", actor="cli:root@host")

    # Assert
    events = list_audit(session, target=f"apikey:{issued.key.prefix}")
    assert [e.action for e in events] == ["apikey.create", "apikey.revoke"]
    assert events[0].detail == {"name": "ops", "role": "admin", "prefix": issued.key.prefix}
    records = [json.loads(e.record) for e in list_entries(session, limit=1000)]
    assert [r["kind"] for r in records[-2:]] == ["audit", "audit"]
    text = b"".join(e.record for e in list_entries(session, limit=1000))
    assert hash_token(issued.token).encode() not in text and issued.token.encode() not in text
    assert verify_ledger(session, public_key=populated.signer.public_key).ok


def test_ledger_stats(session: Session, populated: Populated) -> None:
    stats = ledger_stats(session)
    assert stats.rounds == 1 and stats.checkpoint_size > 0
    assert stats.entries >= stats.checkpoint_size
    assert stats.contributors == {"active": 1, "banned": 1}
