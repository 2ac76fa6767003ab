"""Operators' REST API keys: issue, list, revoke, and check a presented bearer token.

A token reads ``zgk_<prefix>_<secret>``: `prefix` is 8 random hex digits that find the key's row,
`secret` 32 random bytes (base64url). Only SHA-256(token) is stored; a presented token is hashed
and compared with the stored digest in constant time, so the database never holds anything that
grants access. Issuing and revoking a key append an audit event (name, role, prefix; never the
digest) to the Merkle log in the same transaction, so who was given access, by whom and when is
verifiable like every other decision.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

from sqlmodel import Session, col, select

from zoo_gym.ledger.log import append_entry
from zoo_gym.ledger.models import API_ROLES, ApiKey, AuditEvent, utcnow
from zoo_gym.ledger.repository import LedgerError, NotFound, _check, _writing

TOKEN_SCHEME = "zgk"
PREFIX_HEX = 8
MAX_NAME = 64


@dataclass(frozen=True)
class IssuedKey:
    """A new key's row and its token; the token is shown once and never stored."""

    key: ApiKey
    token: str


def hash_token(token: str) -> str:
    """Hex SHA-256 of a token, the only form of it the ledger keeps."""
    return hashlib.sha256(token.encode()).hexdigest()


def token_prefix(token: str) -> str | None:
    """The lookup prefix of a well-formed API key token, else None."""
    parts = token.split("_", 2)
    if len(parts) != 3 or parts[0] != TOKEN_SCHEME or not parts[2]:
        return None
    prefix = parts[1]
    if len(prefix) != PREFIX_HEX or any(c not in "0123456789abcdef" for c in prefix):
        return None
    return prefix


def _audit(session: Session, *, actor: str, action: str, key: ApiKey) -> None:
    event = AuditEvent(
        actor=actor,
        action=action,
        target=f"apikey:{key.prefix}",
        detail={"name": key.name, "role": key.role, "prefix": key.prefix},
    )
    session.add(event)
    session.flush()
    append_entry(session, kind="audit", changes=[(event, None)])


def create_api_key(session: Session, *, name: str, role: str, actor: str) -> IssuedKey:
    """Issue a key with `role` ("admin" or "viewer"); returns the row and the token to hand out."""
    _check(role, API_ROLES, "role")
    name = name.strip()
    if not name or len(name) > MAX_NAME:
        raise LedgerError(f"a key needs a name of 1 to {MAX_NAME} characters")
    with _writing(session):
        while True:
            prefix = secrets.token_hex(PREFIX_HEX // 2)
            taken = session.exec(select(ApiKey.id).where(ApiKey.prefix == prefix)).first()
            if taken is None:
                break
        token = f"{TOKEN_SCHEME}_{prefix}_{secrets.token_urlsafe(32)}"
        key = ApiKey(name=name, role=role, prefix=prefix, secret_sha256=hash_token(token))
        session.add(key)
        session.flush()
        _audit(session, actor=actor, action="apikey.create", key=key)
    session.refresh(key)
    return IssuedKey(key, token)


def list_api_keys(session: Session, *, include_revoked: bool = True) -> list[ApiKey]:
    query = select(ApiKey).order_by(col(ApiKey.id))
    if not include_revoked:
        query = query.where(col(ApiKey.revoked_at).is_(None))
    return list(session.exec(query).all())


def active_key_digests(session: Session) -> dict[str, str]:
    """prefix -> SHA-256 digest of every active key: what a caller needs to check presented
    tokens without a query per token (it must read this again to see keys issued since)."""
    query = select(ApiKey.prefix, ApiKey.secret_sha256).where(col(ApiKey.revoked_at).is_(None))
    return dict(session.exec(query).all())


def _find(session: Session, key: str) -> ApiKey:
    row = session.exec(select(ApiKey).where(ApiKey.prefix == key)).first()
    if row is not None:
        return row
    named = list(
        session.exec(
            select(ApiKey).where(ApiKey.name == key, col(ApiKey.revoked_at).is_(None))
        ).all()
    )
    if not named:
        raise NotFound(f"no active API key with prefix or name {key!r}")
    if len(named) > 1:
        prefixes = ", ".join(k.prefix for k in named)
        raise LedgerError(
            f"{len(named)} active keys are named {key!r}; revoke by prefix ({prefixes})"
        )
    return named[0]


def revoke_api_key(session: Session, *, key: str, actor: str) -> ApiKey:
    """Revoke the key whose prefix (or, when unique among active keys, name) is `key`."""
    with _writing(session):
        row = _find(session, key)
        if row.revoked_at is not None:
            raise LedgerError(f"API key {row.prefix} ({row.name}) is already revoked")
        row.revoked_at = utcnow()
        session.add(row)
        session.flush()
        _audit(session, actor=actor, action="apikey.revoke", key=row)
    session.refresh(row)
    return row


def authenticate_api_key(session: Session, *, token: str) -> ApiKey | None:
    """The active key `token` belongs to, or None (malformed, unknown, wrong secret, revoked)."""
    digest = hash_token(token)
    prefix = token_prefix(token)
    row = None
    if prefix is not None:
        row = session.exec(select(ApiKey).where(ApiKey.prefix == prefix)).first()
    stored = row.secret_sha256 if row is not None else "0" * len(digest)
    if not hmac.compare_digest(stored, digest) or row is None or row.revoked_at is not None:
        return None
    return row
