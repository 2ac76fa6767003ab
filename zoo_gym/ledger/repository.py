"""Repository functions: the only way rows change.

Every function takes the session first and everything else by keyword. A write takes the log's
append lock, changes its rows, appends the log entry describing them (`append_entry`) and commits,
all in one transaction; on any error it rolls back (releasing the lock) and raises.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from decimal import Decimal
from typing import Any

from sqlalchemy import bindparam, func, insert, update
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, SQLModel, col, select

from zoo_gym.core.identity import Identity
from zoo_gym.ledger.log import append_entries, append_entry, lock_log, sign_head
from zoo_gym.ledger.models import (
    CLOSED_ROUND_STATUSES,
    CONTRIBUTOR_STATUSES,
    DECISIONS,
    ROUND_STATUSES,
    AggregationDecision,
    AuditEvent,
    Contributor,
    DpMechanism,
    ModelVersion,
    Reward,
    Round,
    Submission,
    utcnow,
)
from zoo_gym.ledger.records import Written


class LedgerError(Exception):
    """A request the ledger refuses; the message says what was wrong."""


class NotFound(LedgerError):
    """The named contributor, round or submission does not exist."""


class DuplicateSubmission(LedgerError):
    """The contributor already has an accepted submission in this round."""


class ReplayedNonce(LedgerError):
    """The contributor already used this nonce."""


class ContributorKeyMismatch(LedgerError):
    """The contributor id is registered with a different public key."""


@contextmanager
def _writing(session: Session) -> Iterator[None]:
    """One serialised write transaction: lock, body, commit; rollback on any error."""
    try:
        lock_log(session)
        yield
        session.commit()
    except BaseException:
        session.rollback()
        raise


def _check(value: str, allowed: frozenset[str], what: str) -> None:
    if value not in allowed:
        raise LedgerError(f"{what} {value!r} is not one of {', '.join(sorted(allowed))}")


# --- contributors -------------------------------------------------------------------------------


def register_contributor(
    session: Session, *, contributor_id: str, public_key: bytes, name: str, status: str = "active"
) -> Contributor:
    """Register a contributor; registering the same id with the same key again returns it as is."""
    _check(status, CONTRIBUTOR_STATUSES, "status")
    with _writing(session):
        existing = registered(session, contributor_id=contributor_id, public_key=public_key)
        if existing is not None:
            return existing
        contributor = Contributor(
            contributor_id=contributor_id, public_key=bytes(public_key), name=name, status=status
        )
        session.add(contributor)
        session.flush()
        append_entry(session, kind="contributor", changes=[(contributor, None)])
    session.refresh(contributor)
    return contributor


def registered(session: Session, *, contributor_id: str, public_key: bytes) -> Contributor | None:
    """The row of `contributor_id` when registered with `public_key`; None when not registered.
    Raises ContributorKeyMismatch when the id is registered with another key."""
    existing = session.get(Contributor, contributor_id)
    if existing is not None and bytes(existing.public_key) != bytes(public_key):
        raise ContributorKeyMismatch(
            f"contributor {contributor_id} is registered with another public key"
        )
    return existing


def get_contributor(session: Session, *, contributor_id: str) -> Contributor | None:
    return session.get(Contributor, contributor_id)


def contributor_ids(session: Session) -> set[str]:
    """Every registered contributor's id, whatever its status."""
    return set(session.exec(select(Contributor.contributor_id)).all())


def list_contributors(session: Session, *, status: str | None = None) -> list[Contributor]:
    query = select(Contributor).order_by(
        col(Contributor.created_at), col(Contributor.contributor_id)
    )
    if status is not None:
        query = query.where(Contributor.status == status)
    return list(session.exec(query).all())


def set_contributor_status(
    session: Session, *, contributor_id: str, status: str, reason: str, actor: str
) -> Contributor:
    """Approve, ban or suspend a contributor; the change and who made it go in the log."""
    _check(status, CONTRIBUTOR_STATUSES, "status")
    with _writing(session):
        contributor = session.get(Contributor, contributor_id)
        if contributor is None:
            raise NotFound(f"no contributor {contributor_id}")
        contributor.status = status
        contributor.status_reason = reason
        event = AuditEvent(
            actor=actor,
            action="contributor.status",
            target=contributor_id,
            detail={"status": status, "reason": reason},
        )
        session.add_all([contributor, event])
        session.flush()
        append_entry(
            session,
            kind="contributor_status",
            changes=[(contributor, ["status", "status_reason"]), (event, None)],
        )
    session.refresh(contributor)
    return contributor


# --- rounds -------------------------------------------------------------------------------------


def open_round(
    session: Session, *, number: int, base_version: str, seed: int, aggregator: str, codec: str
) -> Round:
    """Open round `number` on `base_version`."""
    with _writing(session):
        if session.get(Round, number) is not None:
            raise LedgerError(f"round {number} already exists")
        round_ = Round(
            number=number, base_version=base_version, seed=seed, aggregator=aggregator, codec=codec
        )
        session.add(round_)
        session.flush()
        append_entry(session, kind="round_open", changes=[(round_, None)])
    session.refresh(round_)
    return round_


def _open_round_row(session: Session, number: int) -> Round:
    round_ = session.get(Round, number)
    if round_ is None:
        raise NotFound(f"no round {number}")
    if round_.status in CLOSED_ROUND_STATUSES:
        raise LedgerError(f"round {number} is already {round_.status}")
    return round_


def set_round_status(session: Session, *, number: int, status: str) -> Round:
    """Move an unfinished round to `status` (e.g. "aggregating")."""
    _check(status, ROUND_STATUSES - CLOSED_ROUND_STATUSES, "status")
    with _writing(session):
        round_ = _open_round_row(session, number)
        round_.status = status
        session.add(round_)
        session.flush()
        append_entry(session, kind="round_status", changes=[(round_, ["status"])])
    session.refresh(round_)
    return round_


def close_round(
    session: Session,
    *,
    number: int,
    status: str,
    new_version: str | None = None,
    metrics: dict[str, Any],
    signer: Identity | None = None,
) -> Round:
    """Close a round as published, rolled_back or aborted, with its metrics.

    With `signer`, the checkpoint that covers the close is signed in the same transaction: a
    round is never closed without it (`verify_ledger` requires one after every published or
    rolled-back round); `latest_checkpoint` returns it.
    """
    _check(status, CLOSED_ROUND_STATUSES, "closing status")
    with _writing(session):
        round_ = _open_round_row(session, number)
        round_.status = status
        round_.closed_at = utcnow()
        round_.new_version = new_version
        round_.metrics = dict(metrics)
        session.add(round_)
        session.flush()
        append_entry(
            session,
            kind="round_close",
            changes=[(round_, ["status", "closed_at", "new_version", "metrics"])],
        )
        if signer is not None:
            sign_head(session, signer=signer)
    session.refresh(round_)
    return round_


def get_round(session: Session, *, number: int) -> Round | None:
    return session.get(Round, number)


def list_rounds(session: Session) -> list[Round]:
    return list(session.exec(select(Round).order_by(col(Round.number))).all())


def latest_round(session: Session) -> Round | None:
    return session.exec(select(Round).order_by(col(Round.number).desc())).first()


# --- submissions --------------------------------------------------------------------------------


def _refuse_repeats(
    session: Session, round_number: int, contributor_id: str, nonce: str, *, accepted: bool
) -> None:
    """`ReplayedNonce` for a nonce the contributor used before; with `accepted`,
    `DuplicateSubmission` when it already has an accepted submission in the round."""
    replay = session.exec(
        select(Submission.id).where(
            Submission.contributor_id == contributor_id, Submission.nonce == nonce
        )
    ).first()
    if replay is not None:
        raise ReplayedNonce(f"contributor {contributor_id} already used nonce {nonce}")
    if not accepted:
        return
    earlier = session.exec(
        select(Submission.id).where(
            Submission.round_number == round_number,
            Submission.contributor_id == contributor_id,
            Submission.decision == "accepted",
        )
    ).first()
    if earlier is not None:
        raise DuplicateSubmission(
            f"contributor {contributor_id} already has accepted submission {earlier} "
            f"in round {round_number}"
        )


def _insert(session: Session, row: SQLModel) -> None:
    """Write `row` with one INSERT of every column as it stands (its defaults included), in the
    session's transaction, bypassing the unit of work; a generated primary key is set on it."""
    table = row.__table__  # type: ignore[attr-defined]
    (key,) = table.primary_key.columns
    values = {c.name: getattr(row, c.name) for c in table.columns}
    if values[key.name] is None:
        del values[key.name]
    result = session.connection().execute(insert(table), values)
    if key.name not in values:
        (generated,) = result.inserted_primary_key or (None,)
        setattr(row, key.name, generated)


def record_submission(
    session: Session,
    *,
    round_number: int,
    contributor_id: str,
    nonce: str,
    base_version: str,
    payload_sha256: str,
    size_bytes: int,
    decision: str,
    reason: str,
    epsilon: float | None = None,
    dp: DpMechanism | None = None,
) -> Submission:
    """Record a received submission and the decision about it (`epsilon` and `dp`: the privacy
    it reports and the DP-SGD mechanism it states).

    Raises `ReplayedNonce` when the contributor used `nonce` before (whatever that decision was),
    and `DuplicateSubmission` for a second accepted submission in the same round: the table's
    unique indexes refuse such a row, and only then are the earlier rows looked up to say which.
    The row and its log entry are two INSERTs and one commit; the row is returned as written
    (it is not in the session).
    """
    _check(decision, DECISIONS, "decision")
    submission = Submission(
        round_number=round_number,
        contributor_id=contributor_id,
        nonce=nonce,
        base_version=base_version,
        payload_sha256=payload_sha256,
        size_bytes=size_bytes,
        decision=decision,
        reason=reason,
        epsilon=epsilon,
    )
    if dp is not None:
        submission.dp_noise_multiplier = dp.noise_multiplier
        submission.dp_sample_rate = dp.sample_rate
        submission.dp_steps = dp.steps
        submission.dp_delta = dp.delta
        submission.dp_accountant = dp.accountant
    try:
        with _writing(session):
            _insert(session, submission)
            append_entry(session, kind="submission", changes=[(submission, None)])
    except IntegrityError:
        accepted = decision == "accepted"
        _refuse_repeats(session, round_number, contributor_id, nonce, accepted=accepted)
        raise
    return submission


def count_submissions(session: Session, *, round_number: int, contributor_id: str) -> int:
    """How many submissions of `contributor_id` are recorded under round `round_number`."""
    query = (
        select(func.count())
        .select_from(Submission)
        .where(Submission.round_number == round_number)
        .where(Submission.contributor_id == contributor_id)
    )
    return int(session.connection().execute(query).scalar_one())


def record_aggregation(
    session: Session,
    *,
    submission_id: int,
    selected: bool,
    weight: float,
    trimmed_share: float,
    score: float | None,
    reason: str,
) -> Submission:
    """Record what the aggregator did with an accepted submission."""
    decision = AggregationDecision(submission_id, selected, weight, trimmed_share, score, reason)
    return record_aggregations(session, decisions=[decision])[0]


def record_aggregations(
    session: Session, *, decisions: Sequence[AggregationDecision]
) -> list[Submission]:
    """Record what the aggregator did with each of a round's accepted submissions, in one
    transaction (one log entry per submission): all of them or, on any error, none.

    The submissions are read with one SELECT, changed with one UPDATE per decision sent as one
    batch, and their log entries written with one INSERT."""
    ids = sorted({d.submission_id for d in decisions})
    with _writing(session):
        found: dict[int | None, Submission] = {}
        for start in range(0, len(ids), _IDS_PER_QUERY):
            chunk = ids[start : start + _IDS_PER_QUERY]
            query = select(Submission).where(col(Submission.id).in_(chunk))
            found.update((s.id, s) for s in session.exec(query))
        changes: list[tuple[AggregationDecision, dict[str, Any]]] = []
        for decision in decisions:
            submission = found.get(decision.submission_id)
            if submission is None:
                raise NotFound(f"no submission {decision.submission_id}")
            if submission.decision != "accepted":
                raise LedgerError(
                    f"submission {decision.submission_id} was rejected; it was not aggregated"
                )
            values = {
                "selected": decision.selected,
                "weight": decision.weight,
                "trimmed_share": decision.trimmed_share,
                "score": decision.score,
                "aggregation_reason": decision.reason,
            }
            changes.append((decision, values))
        if changes:
            session.connection().execute(
                update(Submission).where(col(Submission.id) == bindparam("key")),
                [{"key": decision.submission_id, **values} for decision, values in changes],
            )
        rows = [Written(Submission, {"id": d.submission_id, **values}) for d, values in changes]
        append_entries(
            session, kind="aggregation", changes=[[(row, _AGGREGATION_FIELDS)] for row in rows]
        )
    # expired by the commit: each loads its row again when it is read
    return [found[d.submission_id] for d in decisions]


_IDS_PER_QUERY = 500  # ids bound per SELECT (SQLite's default limit on parameters is 999 or more)
_AGGREGATION_FIELDS = ["selected", "weight", "trimmed_share", "score", "aggregation_reason"]


def list_submissions(
    session: Session, *, round_number: int | None = None, contributor_id: str | None = None
) -> list[Submission]:
    query = select(Submission).order_by(col(Submission.id))
    if round_number is not None:
        query = query.where(Submission.round_number == round_number)
    if contributor_id is not None:
        query = query.where(Submission.contributor_id == contributor_id)
    return list(session.exec(query).all())


# --- rewards ------------------------------------------------------------------------------------


def record_reward(
    session: Session,
    *,
    round_number: int,
    contributor_id: str,
    quality: float | None,
    amount: Decimal | int | str,
    reputation_after: float,
    reason: str = "",
) -> Reward:
    """Pay `amount` (exact; zero with its `reason`) for a round; sets the contributor's reputation
    and its accepted submission's quality and reward."""
    amount = Decimal(amount)
    if not amount.is_finite() or amount < 0:
        raise LedgerError(f"a reward amount must be a finite, non-negative decimal, not {amount}")
    with _writing(session):
        contributor = session.get(Contributor, contributor_id)
        if contributor is None:
            raise NotFound(f"no contributor {contributor_id}")
        if session.get(Round, round_number) is None:
            raise NotFound(f"no round {round_number}")
        reward = Reward(
            round_number=round_number,
            contributor_id=contributor_id,
            quality=quality,
            amount=amount,
            reputation_after=reputation_after,
            reason=reason,
        )
        contributor.reputation = reputation_after
        session.add_all([reward, contributor])
        changes: list[tuple[Any, list[str] | None]] = [
            (reward, None),
            (contributor, ["reputation"]),
        ]
        submission = session.exec(
            select(Submission).where(
                Submission.round_number == round_number,
                Submission.contributor_id == contributor_id,
                Submission.decision == "accepted",
            )
        ).first()
        if submission is not None:
            submission.quality = quality
            submission.reward = amount
            session.add(submission)
            changes.append((submission, ["quality", "reward"]))
        session.flush()
        append_entry(session, kind="reward", changes=changes)
    session.refresh(reward)
    return reward


def list_rewards(
    session: Session, *, round_number: int | None = None, contributor_id: str | None = None
) -> list[Reward]:
    query = select(Reward).order_by(col(Reward.id))
    if round_number is not None:
        query = query.where(Reward.round_number == round_number)
    if contributor_id is not None:
        query = query.where(Reward.contributor_id == contributor_id)
    return list(session.exec(query).all())


# --- model versions -----------------------------------------------------------------------------


def record_model_version(
    session: Session,
    *,
    version: str,
    parent: str | None,
    round_number: int | None,
    manifest_sha256: str,
    path: str,
    metrics: dict[str, Any],
) -> ModelVersion:
    """Record a published base version (e.g. "v0003") and its signed manifest's digest."""
    with _writing(session):
        if session.get(ModelVersion, version) is not None:
            raise LedgerError(f"model version {version} already exists")
        model = ModelVersion(
            version=version,
            parent=parent,
            round_number=round_number,
            manifest_sha256=manifest_sha256,
            path=path,
            metrics=dict(metrics),
        )
        session.add(model)
        session.flush()
        append_entry(session, kind="model_version", changes=[(model, None)])
    session.refresh(model)
    return model


def latest_model_version(session: Session) -> ModelVersion | None:
    query = select(ModelVersion).order_by(
        col(ModelVersion.published_at).desc(), col(ModelVersion.version).desc()
    )
    return session.exec(query).first()


def list_model_versions(session: Session) -> list[ModelVersion]:
    query = select(ModelVersion).order_by(col(ModelVersion.published_at), col(ModelVersion.version))
    return list(session.exec(query).all())


# --- audit --------------------------------------------------------------------------------------


def record_audit(
    session: Session, *, actor: str, action: str, target: str, detail: dict[str, Any]
) -> AuditEvent:
    """Record an operator or coordinator action."""
    with _writing(session):
        event = AuditEvent(actor=actor, action=action, target=target, detail=dict(detail))
        session.add(event)
        session.flush()
        append_entry(session, kind="audit", changes=[(event, None)])
    session.refresh(event)
    return event


def list_audit(session: Session, *, target: str | None = None) -> list[AuditEvent]:
    query = select(AuditEvent).order_by(col(AuditEvent.id))
    if target is not None:
        query = query.where(AuditEvent.target == target)
    return list(session.exec(query).all())
