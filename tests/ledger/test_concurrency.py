"""Writers on several threads at once produce one consistent log."""

from __future__ import annotations

import threading

from sqlalchemy import Engine
from sqlmodel import Session

from zoo_gym.core.identity import Identity
from zoo_gym.ledger import checkpoint, log_size, verify_ledger
from zoo_gym.ledger import repository as repo

THREADS = 6
PER_THREAD = 8


def test_concurrent_submissions(engine: Engine) -> None:
    signer = Identity.generate()
    people = [Identity.generate() for _ in range(THREADS)]
    with Session(engine) as session:
        for who in people:
            repo.register_contributor(
                session, contributor_id=who.contributor_id, public_key=who.public_key, name="c"
            )
        for number in range(1, PER_THREAD + 1):
            repo.open_round(
                session, number=number, base_version="v0", seed=number, aggregator="m", codec="c"
            )
    barrier = threading.Barrier(THREADS)
    errors: list[BaseException] = []
    duplicates: list[int] = []

    def work(who: Identity) -> None:
        try:
            barrier.wait()
            with Session(engine) as session:
                for number in range(1, PER_THREAD + 1):
                    for attempt in range(2):  # the second accepted one in a round is refused
                        try:
                            repo.record_submission(
                                session,
                                round_number=number,
                                contributor_id=who.contributor_id,
                                nonce=f"{number}-{attempt}",
                                base_version="v0",
                                payload_sha256="00" * 32,
                                size_bytes=number,
                                decision="accepted",
                                reason="ok",
                            )
                        except repo.DuplicateSubmission:
                            duplicates.append(number)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(who,)) for who in people]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert len(duplicates) == THREADS * PER_THREAD
    with Session(engine) as session:
        assert len(repo.list_submissions(session)) == THREADS * PER_THREAD
        assert log_size(session) == THREADS + PER_THREAD + THREADS * PER_THREAD
        checkpoint(session, signer=signer)
        report = verify_ledger(session, public_key=signer.public_key)
        assert report.ok, report.problems
