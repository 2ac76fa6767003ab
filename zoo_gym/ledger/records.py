"""Log records: the canonical bytes a log entry holds for the rows a change wrote.

A record is canonical JSON (`zoo_gym.core.hashing.canonical_json`):

    {"v": 2, "index": i, "kind": "...", "rows": [{"table": t, "key": k, "fields": {...}}]}

`fields` holds the new values of the columns the change set, in the same normalised form
`row_content` derives from a stored row, so a record and the row it describes compare equal on
every backend. Version 1 wrote exact amounts as floats; `_from_v1` reads them in today's form.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import (
    JSON,
    Boolean,
    DateTime,
    Float,
    Integer,
    LargeBinary,
    Numeric,
    TypeDecorator,
)
from sqlmodel import SQLModel

from zoo_gym.core.hashing import canonical_json
from zoo_gym.ledger.models import (
    AuditEvent,
    Contributor,
    ModelVersion,
    Reward,
    Round,
    Submission,
)

RECORD_VERSION = 2
READABLE_VERSIONS = (1, 2)  # 1: amounts as floats (before exact decimals)

LOGGED_TABLES: tuple[type[SQLModel], ...] = (
    Contributor,
    Round,
    Submission,
    Reward,
    ModelVersion,
    AuditEvent,
)

_COLUMN_TYPES: dict[tuple[str, str], Any] = {
    (str(m.__table__.name), c.name): c.type  # type: ignore[attr-defined]
    for m in LOGGED_TABLES
    for c in m.__table__.columns  # type: ignore[attr-defined]
}
# Float subclasses Numeric; only exact NUMERIC columns changed form between versions
_COLUMN_TYPES = {k: t for k, t in _COLUMN_TYPES.items() if not isinstance(t, Float)}


@dataclass(frozen=True)
class Written:
    """A row changed by a statement rather than through a mapped object: its model and the
    values of the columns written (the primary key among them)."""

    model: type[SQLModel]
    values: Mapping[str, Any]


Row = SQLModel | Written
RowChange = tuple[Row, Sequence[str] | None]
"""A row and the columns of it a log entry records (None: every column)."""


def _normalise(column_type: Any, value: Any) -> Any:
    """JSON form of a column value, identical before and after a round trip through any backend."""
    if value is None:
        return None
    if isinstance(column_type, TypeDecorator):
        column_type = column_type.impl_instance
    if isinstance(column_type, Boolean):
        return bool(value)
    if isinstance(column_type, Integer):
        return int(value)
    if isinstance(column_type, Float):
        return float(value)
    if isinstance(column_type, Numeric):  # exact decimals, as a fixed-scale string on every backend
        return format(Decimal(value).quantize(Decimal(1).scaleb(-(column_type.scale or 0))), "f")
    if isinstance(column_type, DateTime):
        if isinstance(value, datetime):
            return _utc(value).isoformat(timespec="microseconds")
        return str(value)
    if isinstance(column_type, LargeBinary):
        return bytes(value).hex()
    if isinstance(column_type, JSON):
        return json.loads(canonical_json(value))
    return value


def _utc(moment: datetime) -> datetime:
    """`moment` in UTC; a naive datetime is taken to be UTC already."""
    if moment.utcoffset() is None:
        return moment.replace(tzinfo=UTC)
    return moment.astimezone(UTC)


def _table(row: Row) -> Any:
    model: Any = row.model if isinstance(row, Written) else row
    return model.__table__


def _value(row: Row, column: str) -> Any:
    return row.values[column] if isinstance(row, Written) else getattr(row, column)


def row_content(row: Row) -> dict[str, Any]:
    """Every column of `row` as JSON values (datetimes ISO 8601, bytes hex, floats as floats)."""
    return {c.name: _normalise(c.type, _value(row, c.name)) for c in _table(row).columns}


def _fields(row: Row, columns: Sequence[str]) -> dict[str, Any]:
    """The named columns of `row` as `row_content` has them (the others are not read)."""
    table = _table(row)
    return {c: _normalise(table.columns[c].type, _value(row, c)) for c in columns}


def row_key(row: Row) -> Any:
    """The primary-key value of `row`, in its JSON form."""
    (pk,) = _table(row).primary_key.columns
    return _normalise(pk.type, _value(row, pk.name))


def _table_name(row: Row) -> str:
    return str(_table(row).name)


def _from_v1(table: str, column: str, value: Any) -> Any:
    """A version-1 field in today's form: amounts were floats before they became exact decimals."""
    column_type = _COLUMN_TYPES.get((table, column))
    if value is None or column_type is None or not isinstance(column_type, Numeric):
        return value
    return _normalise(column_type, value)


def build_record(index: int, kind: str, changes: Sequence[RowChange]) -> bytes:
    """Canonical bytes of log entry `index` describing `changes` (record version 2: exact amounts
    as fixed-scale strings; version 1 wrote them as floats and is still verified)."""
    rows = []
    for row, columns in changes:
        fields = row_content(row) if columns is None else _fields(row, columns)
        rows.append({"table": _table_name(row), "key": row_key(row), "fields": fields})
    record = {"v": RECORD_VERSION, "index": index, "kind": kind, "rows": rows}
    return canonical_json(record)
