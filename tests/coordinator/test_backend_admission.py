"""Registration under the admission policy, in-process: allowances for new keys per address and
overall, known keys that spend nothing, pending keys under approval, codes under invite."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import pytest
from sqlmodel import Session

from zoo_gym import ledger
from zoo_gym.coordinator.admission import IMPATIENCE_BURST, AdmissionPolicy
from zoo_gym.coordinator.backend import CoordinatorBackend
from zoo_gym.coordinator.registry import ModelRegistry
from zoo_gym.core.identity import Identity
from zoo_gym.core.protocol import RequestError, register_statement
from zoo_gym.transport.limits import TokenBuckets


@pytest.fixture
def backend(tiny_home: Path) -> CoordinatorBackend:
    signer = Identity.load(tiny_home / "coordinator.key")
    return CoordinatorBackend(
        engine=ledger.open_database(f"sqlite:///{tiny_home / 'ledger.db'}"),
        registry=ModelRegistry(tiny_home / "models", signer),
        signer=signer,
        payload_dir=tiny_home / "payloads",
        max_upload_bytes=1 << 20,
        admission=AdmissionPolicy("open", 1e-6, 3, 1e-6, 2),  # no refill within a test
    )


def join(backend: CoordinatorBackend, who: Identity, *, peer: str | None, invite: str = "") -> str:
    ts = int(time.time() * 1000)
    return backend.register(
        public_key=who.public_key,
        name="x",
        timestamp_ms=ts,
        signature=who.sign(register_statement(who.public_key, "x", ts)),
        invite=invite,
        peer=peer,
    ).status


def rows(backend: CoordinatorBackend) -> int:
    with Session(backend.engine) as session:
        return len(ledger.list_contributors(session))


def test_new_keys_spend_the_address_and_overall_allowances(backend: CoordinatorBackend) -> None:
    known = Identity.generate()
    assert join(backend, known, peer="10.0.0.1") == "active"
    assert join(backend, Identity.generate(), peer="10.0.0.1") == "active"
    with pytest.raises(RequestError, match="from your address") as address:
        join(backend, Identity.generate(), peer="10.0.0.1")
    assert join(backend, Identity.generate(), peer="10.0.0.2") == "active"
    with pytest.raises(RequestError, match=r"the coordinator takes 1e-06 per second") as overall:
        join(backend, Identity.generate(), peer="10.0.0.3")

    assert address.value.code == overall.value.code == "RESOURCE_EXHAUSTED"
    assert join(backend, known, peer="10.0.0.1") == "active"  # a known key spends nothing
    assert join(backend, Identity.generate(), peer=None) == "active"  # in-process callers
    assert rows(backend) == 4


def test_approval_holds_new_keys_and_invite_needs_a_code(backend: CoordinatorBackend) -> None:
    backend.admission = AdmissionPolicy("approval")
    assert join(backend, Identity.generate(), peer="10.0.0.1") == "pending"

    backend.admission = AdmissionPolicy("invite")
    with pytest.raises(RequestError, match="by invitation only") as refused:
        join(backend, Identity.generate(), peer="10.0.0.1")
    with Session(backend.engine) as session:
        code = ledger.create_invite(
            session, note="", max_uses=1, valid_for=timedelta(days=1), actor="op"
        ).code
    assert join(backend, Identity.generate(), peer="10.0.0.1", invite=code) == "active"
    with pytest.raises(RequestError, match="used up"):
        join(backend, Identity.generate(), peer="10.0.0.1", invite=code)

    assert refused.value.code == "PERMISSION_DENIED" and rows(backend) == 2


def test_a_flood_of_new_keys_is_refused_before_the_signature_and_the_database(
    backend: CoordinatorBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: one key known from an earlier start, the address's allowance spent
    known = Identity.generate()
    assert join(backend, known, peer="10.0.0.1") == "active"
    assert join(backend, Identity.generate(), peer="10.0.0.1") == "active"
    restarted = CoordinatorBackend(
        engine=backend.engine,
        registry=backend.registry,
        signer=backend.signer,
        payload_dir=backend.payload_dir,
        max_upload_bytes=backend.max_upload_bytes,
        admission=backend.admission,
    )
    restarted.keys._new_keys_by_address.take("10.0.0.1")
    restarted.keys._new_keys_by_address.take("10.0.0.1")
    assert join(restarted, known, peer="10.0.0.1") == "active"  # the ledger's keys are known
    lookups: list[str] = []
    get_contributor = ledger.get_contributor

    def counted(session: Session, *, contributor_id: str) -> object:
        lookups.append(contributor_id)
        return get_contributor(session, contributor_id=contributor_id)

    monkeypatch.setattr(ledger, "get_contributor", counted)
    stranger = Identity.generate()
    ts = int(time.time() * 1000)

    # Execute: a new key with a signature that verifies for nothing
    with pytest.raises(RequestError, match="from your address") as refused:
        restarted.register(
            public_key=stranger.public_key,
            name="x",
            timestamp_ms=ts,
            signature=b"\0" * 64,
            peer="10.0.0.1",
        )

    # Assert: refused for the allowance, without a lookup; a known key still answers
    assert refused.value.code == "RESOURCE_EXHAUSTED" and lookups == []
    assert join(restarted, known, peer="10.0.0.1") == "active"
    assert rows(restarted) == 2


def test_the_reserve_is_left_to_addresses_that_wait_when_told(
    backend: CoordinatorBackend,
) -> None:
    backend.admission = AdmissionPolicy("open", 1e-6, 4, 1e-6, 100, reserve=2)
    for _ in range(4):  # a patient address may take the whole overall allowance
        join(backend, Identity.generate(), peer="10.0.0.9")
    for _ in range(IMPATIENCE_BURST + 1):  # then it keeps asking while refused
        with pytest.raises(RequestError, match="the coordinator takes"):
            join(backend, Identity.generate(), peer="10.0.0.9")
    backend.keys._new_keys = TokenBuckets(1e-6, 4)  # the overall allowance has refilled

    flood = [join(backend, Identity.generate(), peer="10.0.0.9") for _ in range(2)]
    with pytest.raises(RequestError, match="the coordinator takes"):
        join(backend, Identity.generate(), peer="10.0.0.9")  # the reserve is not for it
    newcomers = [join(backend, Identity.generate(), peer=f"10.0.1.{i}") for i in range(2)]

    assert flood == newcomers == ["active", "active"]
    assert rows(backend) == 8
