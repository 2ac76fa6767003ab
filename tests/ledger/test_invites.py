"""Invitation codes: only a hash is stored, each use is spent and recorded with the key it
admitted, and revoked, expired or used-up codes admit nobody."""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING

import pytest
from sqlmodel import Session

from zoo_gym.core.identity import Identity
from zoo_gym.ledger import (
    InviteRefused,
    LedgerError,
    NotFound,
    create_invite,
    get_contributor,
    list_audit,
    list_contributors,
    list_entries,
    list_invites,
    register_with_invite,
    revoke_invite,
    verify_ledger,
)
from zoo_gym.ledger.apikeys import hash_token
from zoo_gym.ledger.invites import invite_prefix

if TYPE_CHECKING:
    from conftest import Populated

DAY = timedelta(days=1)


def _join(session: Session, code: str, who: Identity | None = None) -> str:
    who = who or Identity.generate()
    row = register_with_invite(
        session,
        code=code,
        contributor_id=who.contributor_id,
        public_key=who.public_key,
        name="newcomer",
        status="active",
    )
    return row.contributor_id


def test_code_is_shown_once_and_stored_as_a_hash(session: Session) -> None:
    # Execute
    issued = create_invite(session, note="lab A", max_uses=2, valid_for=DAY, actor="op")

    # Assert
    (row,) = list_invites(session)
    assert issued.code.startswith(f"zgi_{row.prefix}_") and invite_prefix(issued.code) == row.prefix
    assert row.secret_sha256 == hash_token(issued.code) and issued.code not in row.secret_sha256
    assert (row.uses, row.max_uses, row.note, row.created_by) == (0, 2, "lab A", "op")


def test_a_code_admits_its_uses_and_then_nobody(session: Session, populated: Populated) -> None:
    # Prepare
    issued = create_invite(session, note="", max_uses=2, valid_for=DAY, actor="op")
    again = Identity.generate()
    before = len(list_contributors(session))

    # Execute
    first = _join(session, issued.code, again)
    repeat = _join(session, issued.code, again)  # a known key spends nothing
    second = _join(session, issued.code)

    # Assert
    assert first == repeat and get_contributor(session, contributor_id=second) is not None
    with pytest.raises(InviteRefused, match="used up"):
        _join(session, issued.code)
    assert len(list_contributors(session)) == before + 2
    (row,) = list_invites(session)
    assert row.uses == 2 and list_invites(session, include_spent=False) == []
    uses = [e for e in list_audit(session) if e.action == "invite.use"]
    assert [e.detail["contributor"] for e in uses] == [first, second]
    text = b"".join(e.record for e in list_entries(session, limit=1000))
    assert hash_token(issued.code).encode() not in text and issued.code.encode() not in text
    assert verify_ledger(session, public_key=populated.signer.public_key).ok


@pytest.mark.parametrize(
    "mangle",
    [
        lambda c: c[:-1] + ("A" if c[-1] != "A" else "B"),
        lambda c: "zgi_ffffffff_" + c.split("_", 2)[2],
        lambda c: c.replace("zgi_", "zgk_"),
        lambda c: "",
    ],
    ids=["wrong-secret", "unknown-prefix", "scheme", "empty"],
)
def test_other_codes_are_refused_and_write_nothing(session: Session, mangle: object) -> None:
    code = create_invite(session, note="", max_uses=5, valid_for=DAY, actor="op").code
    with pytest.raises(InviteRefused, match="not valid here"):
        _join(session, mangle(code))  # type: ignore[operator]
    assert list_contributors(session) == []


def test_revoked_and_expired_codes_are_refused(session: Session) -> None:
    # Prepare
    revoked = create_invite(session, note="", max_uses=5, valid_for=DAY, actor="op")
    expired = create_invite(
        session, note="", max_uses=5, valid_for=timedelta(minutes=1), actor="op"
    )
    row = expired.invite
    row.expires_at = row.expires_at - timedelta(minutes=2)
    session.add(row)
    session.commit()

    # Execute
    revoke_invite(session, prefix=revoked.invite.prefix, actor="op")

    # Assert
    with pytest.raises(InviteRefused, match="revoked"):
        _join(session, revoked.code)
    with pytest.raises(InviteRefused, match="expired"):
        _join(session, expired.code)
    with pytest.raises(LedgerError, match="already revoked"):
        revoke_invite(session, prefix=revoked.invite.prefix, actor="op")
    with pytest.raises(NotFound):
        revoke_invite(session, prefix="00000000", actor="op")
    assert list_contributors(session) == []


def test_bad_invitations_are_refused(session: Session) -> None:
    with pytest.raises(LedgerError, match="admits 1 to"):
        create_invite(session, note="", max_uses=0, valid_for=DAY, actor="op")
    with pytest.raises(LedgerError, match="valid for"):
        create_invite(session, note="", max_uses=1, valid_for=timedelta(days=400), actor="op")
