"""Invitation codes for `admission = "invite"`: issue, list, revoke, and register with one.

A code reads ``zgi_<prefix>_<secret>``: `prefix` is 8 random hex digits that find the row,
`secret` 32 random bytes (base64url). Only SHA-256(code) is stored; a presented code is hashed
and compared with the stored digest in constant time. A code admits at most `max_uses` new keys
before `expires_at`, unless revoked. Issuing, revoking and each use append an audit event (note,
prefix, uses; never the digest) to the Merkle log; a use is written in the same transaction as
the contributor it admits, so no key is admitted without its code's use on record.
"""

from __future__ import annotations

import hmac
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sqlmodel import Session, col, select

from zoo_gym.ledger.apikeys import hash_token
from zoo_gym.ledger.log import append_entry
from zoo_gym.ledger.models import AuditEvent, Contributor, Invite, utcnow
from zoo_gym.ledger.repository import LedgerError, NotFound, _writing, registered

INVITE_SCHEME = "zgi"
PREFIX_HEX = 8
MAX_NOTE = 128
MAX_USES = 1_000_000
MAX_VALID = timedelta(days=366)


class InviteRefused(LedgerError):
    """A presented invitation code that admits nobody; the message says why in one line."""


@dataclass(frozen=True)
class IssuedInvite:
    """A new invitation's row and its code; the code is shown once and never stored."""

    invite: Invite
    code: str


def invite_prefix(code: str) -> str | None:
    """The lookup prefix of a well-formed invitation code, else None."""
    parts = code.split("_", 2)
    if len(parts) != 3 or parts[0] != INVITE_SCHEME or not parts[2]:
        return None
    prefix = parts[1]
    if len(prefix) != PREFIX_HEX or any(c not in "0123456789abcdef" for c in prefix):
        return None
    return prefix


def _aware(moment: datetime) -> datetime:
    """`moment` as an aware UTC datetime (SQLite hands back naive ones, which are UTC)."""
    return moment.replace(tzinfo=UTC) if moment.utcoffset() is None else moment.astimezone(UTC)


def _audit(session: Session, *, actor: str, action: str, invite: Invite, **extra: object) -> None:
    event = AuditEvent(
        actor=actor,
        action=action,
        target=f"invite:{invite.prefix}",
        detail={
            "note": invite.note,
            "prefix": invite.prefix,
            "max_uses": invite.max_uses,
            "uses": invite.uses,
            **extra,
        },
    )
    session.add(event)
    session.flush()
    append_entry(session, kind="audit", changes=[(event, None)])


def create_invite(
    session: Session, *, note: str, max_uses: int, valid_for: timedelta, actor: str
) -> IssuedInvite:
    """Issue a code admitting up to `max_uses` new keys for `valid_for`; returns row and code."""
    note = note.strip()
    if len(note) > MAX_NOTE:
        raise LedgerError(f"an invitation's note may have at most {MAX_NOTE} characters")
    if not 1 <= max_uses <= MAX_USES:
        raise LedgerError(f"an invitation admits 1 to {MAX_USES} keys, not {max_uses}")
    if not timedelta(seconds=60) <= valid_for <= MAX_VALID:
        raise LedgerError("an invitation is valid for at least a minute and at most 366 days")
    with _writing(session):
        while True:
            prefix = secrets.token_hex(PREFIX_HEX // 2)
            taken = session.exec(select(Invite.id).where(Invite.prefix == prefix)).first()
            if taken is None:
                break
        code = f"{INVITE_SCHEME}_{prefix}_{secrets.token_urlsafe(32)}"
        invite = Invite(
            note=note,
            max_uses=max_uses,
            expires_at=utcnow() + valid_for,
            prefix=prefix,
            secret_sha256=hash_token(code),
            created_by=actor,
        )
        session.add(invite)
        session.flush()
        _audit(session, actor=actor, action="invite.create", invite=invite)
    session.refresh(invite)
    return IssuedInvite(invite, code)


def list_invites(session: Session, *, include_spent: bool = True) -> list[Invite]:
    """Every invitation, oldest first; without `include_spent`, only those that still admit."""
    rows = list(session.exec(select(Invite).order_by(col(Invite.id))).all())
    if include_spent:
        return rows
    return [row for row in rows if _why_not(row) is None]


def revoke_invite(session: Session, *, prefix: str, actor: str) -> Invite:
    """Revoke the invitation with `prefix`; its unused admissions lapse."""
    with _writing(session):
        row = session.exec(select(Invite).where(Invite.prefix == prefix)).first()
        if row is None:
            raise NotFound(f"no invitation with prefix {prefix[:16]!r}")
        if row.revoked_at is not None:
            raise LedgerError(f"invitation {row.prefix} is already revoked")
        row.revoked_at = utcnow()
        session.add(row)
        session.flush()
        _audit(session, actor=actor, action="invite.revoke", invite=row)
    session.refresh(row)
    return row


def _why_not(row: Invite) -> str | None:
    """Why `row` admits nobody now, or None when it still admits."""
    if row.revoked_at is not None:
        return "this invitation code was revoked"
    if _aware(row.expires_at) <= utcnow():
        return "this invitation code has expired"
    if row.uses >= row.max_uses:
        return "this invitation code has been used up"
    return None


def _find_code(session: Session, code: str) -> Invite:
    """The row `code` belongs to, checked in constant time, or InviteRefused."""
    digest = hash_token(code)
    prefix = invite_prefix(code)
    row = None
    if prefix is not None:
        row = session.exec(select(Invite).where(Invite.prefix == prefix)).first()
    stored = row.secret_sha256 if row is not None else "0" * len(digest)
    if not hmac.compare_digest(stored, digest) or row is None:
        raise InviteRefused("this invitation code is not valid here; ask the operator for one")
    return row


def register_with_invite(
    session: Session, *, code: str, contributor_id: str, public_key: bytes, name: str, status: str
) -> Contributor:
    """Register a new contributor admitted by `code`, spending one use of it.

    The contributor row, the code's use count and an "invite.use" audit event are written in
    one transaction. A key already registered is returned as is and spends nothing. Raises
    InviteRefused (unknown, revoked, expired or used-up code) or ContributorKeyMismatch.
    """
    with _writing(session):
        existing = registered(session, contributor_id=contributor_id, public_key=public_key)
        if existing is not None:
            return existing
        invite = _find_code(session, code)
        reason = _why_not(invite)
        if reason is not None:
            raise InviteRefused(f"{reason}; ask the operator for a new one")
        invite.uses += 1
        contributor = Contributor(
            contributor_id=contributor_id, public_key=bytes(public_key), name=name, status=status
        )
        session.add_all([invite, contributor])
        session.flush()
        append_entry(session, kind="contributor", changes=[(contributor, None)])
        _audit(
            session,
            actor=f"contributor:{contributor_id}",
            action="invite.use",
            invite=invite,
            contributor=contributor_id,
        )
    session.refresh(contributor)
    return contributor
