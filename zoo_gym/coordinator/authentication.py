"""Who is calling: a contributor's signed call checked against its registered key.

Checks run cheapest first (the nonce's shape, the key, the signature, the clock) and a call's
nonce is spent only once its signature verified, so strangers cannot fill the replay cache.
"""

from __future__ import annotations

import re
import time

from zoo_gym import ledger
from zoo_gym.coordinator.replay import NonceCache
from zoo_gym.core.identity import CONTRIBUTOR_ID, node_id, verify
from zoo_gym.core.protocol import CALL_NONCE_BYTES, RequestError, request_statement
from zoo_gym.ledger import Engine, Session


def check_clock(timestamp_ms: int, *, clock_skew_s: float) -> None:
    """Refuse a statement stamped more than `clock_skew_s` away from this machine's clock."""
    skew = timestamp_ms / 1000 - time.time()
    if abs(skew) > clock_skew_s:
        raise RequestError(
            "UNAUTHENTICATED",
            f"your clock is {abs(skew):.0f} s {'ahead of' if skew > 0 else 'behind'} the coordinator's "
            f"(limit {clock_skew_s:.0f} s); "
            "synchronise it (e.g. enable NTP) and retry",
        )


def registered_key(engine: Engine, cid: str) -> tuple[bytes, str, str]:
    """(raw public key, status, status reason) of a registered contributor; else RequestError."""
    if not re.fullmatch(CONTRIBUTOR_ID, cid):
        raise RequestError(
            "UNAUTHENTICATED",
            "contributor id must be the 32 hex digits derived from your key; use the id `gym-client init` printed",
        )
    with Session(engine) as session:
        row = ledger.get_contributor(session, contributor_id=cid)
        if row is None:
            raise RequestError(
                "UNAUTHENTICATED",
                f"contributor {cid[:12]} is not registered here; run `gym-client join` to register your key",
            )
        key = row.public_key if isinstance(row.public_key, bytes) else bytes.fromhex(row.public_key)
        return key, row.status, row.status_reason or ""


def authenticate(
    engine: Engine,
    nonces: NonceCache,
    *,
    clock_skew_s: float,
    method: str,
    contributor_id: str,
    timestamp_ms: int,
    nonce: bytes,
    digest: str,
    signature: bytes,
) -> int:
    """Check a signed call, cheapest first, spend its nonce once the signature verified, and
    return the caller's node id."""
    if not nonce:
        raise RequestError(
            "UNAUTHENTICATED",
            "this client does not send per-call nonces; upgrade zoo-gym",
        )
    if len(nonce) != CALL_NONCE_BYTES:
        raise RequestError(
            "UNAUTHENTICATED",
            f"a call's nonce must be {CALL_NONCE_BYTES} random bytes, not {len(nonce)}; "
            "send a fresh one with every call",
        )
    key, status, reason = registered_key(engine, contributor_id)
    statement = request_statement(method, contributor_id, timestamp_ms, nonce, digest)
    if not verify(key, signature, statement):
        raise RequestError(
            "UNAUTHENTICATED",
            "request signature does not match your registered key; use the key you registered with",
        )
    check_clock(timestamp_ms, clock_skew_s=clock_skew_s)
    # only a verified call is remembered, so strangers cannot fill the cache
    if not nonces.admit(contributor_id, nonce, timestamp_ms):
        raise RequestError(
            "UNAUTHENTICATED",
            "replayed request: this call's nonce was used before (or the call is older than "
            "replays can still be told apart); make it again with a fresh nonce and timestamp",
        )
    if status == "banned":
        raise RequestError(
            "PERMISSION_DENIED",
            f"this key is banned ({reason or 'no reason given'}); contact the operator",
        )
    if status == "pending" and method != "outcome":
        raise RequestError(
            "PERMISSION_DENIED", "your registration awaits operator approval; try again later"
        )
    return node_id(key)
