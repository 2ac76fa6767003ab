"""Signed checkpoints as they travel outside the database: one JSON object per checkpoint.

A coordinator cannot check itself against rollback: whoever can rewrite its database can also
delete the checkpoints that would betray the rewrite. So checkpoints are kept elsewhere too, by
operators (the `checkpoint_copy` file, `gym-coordinator ledger checkpoint --format json`) and by
contributors (the newest one each verified), and the log must stay consistent with every one.

The JSON form, version 1 (one object per line in a file of several):

    {"v": 1, "size": n, "root": "<hex>", "signed_at": "<ISO 8601, UTC>",
     "signature": "<hex Ed25519>", "public_key": "<hex Ed25519>"}

The signature covers `checkpoint_message(size, root, signed_at)`; `public_key` says who claims to
have signed it and is never trusted on its own: a checker compares it with the key it expects.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from zoo_gym.core.hashing import canonical_json
from zoo_gym.core.identity import verify

CHECKPOINT_VERSION = 1
COPY_FORMAT = 1


class CheckpointFileError(ValueError):
    """A checkpoint file cannot be read; the message names the file, the line and what is wrong."""


def _utc(moment: datetime) -> datetime:
    """`moment` in UTC; a naive datetime is taken to be UTC already."""
    if moment.utcoffset() is None:
        return moment.replace(tzinfo=UTC)
    return moment.astimezone(UTC)


def checkpoint_message(*, size: int, root: str, signed_at: datetime) -> bytes:
    """Canonical bytes a checkpoint signature covers."""
    return canonical_json(
        {
            "v": CHECKPOINT_VERSION,
            "kind": "checkpoint",
            "size": size,
            "root": root,
            "signed_at": _utc(signed_at).isoformat(timespec="microseconds"),
        }
    )


@dataclass(frozen=True)
class SignedCheckpoint:
    """A signed tree head (size, RFC 9162 root) as it is kept outside the database."""

    size: int
    root: str
    signed_at: datetime
    signature: str
    public_key: str = ""

    @classmethod
    def of(cls, head: Any, public_key: bytes) -> SignedCheckpoint:
        """The portable form of a stored `Checkpoint` row signed with `public_key`."""
        return cls(head.size, head.root, _utc(head.signed_at), head.signature, public_key.hex())

    @classmethod
    def from_json(cls, data: Any) -> SignedCheckpoint:
        """Parse the JSON form; `ValueError` says which field is missing or malformed."""
        if not isinstance(data, dict):
            raise ValueError("a checkpoint is a JSON object")
        try:
            size, root = data["size"], data["root"]
            signed_at, signature = data["signed_at"], data["signature"]
        except KeyError as exc:
            raise ValueError(f"the checkpoint has no {exc.args[0]!r}") from None
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ValueError(f"size {size!r} is not a whole number >= 0")
        for name, value in (("root", root), ("signature", signature)):
            if not isinstance(value, str) or not _is_hex(value):
                raise ValueError(f"{name} {value!r} is not hex")
        try:
            moment = datetime.fromisoformat(str(signed_at))
        except ValueError:
            raise ValueError(f"signed_at {signed_at!r} is not an ISO 8601 time") from None
        return cls(size, root, _utc(moment), signature, str(data.get("public_key", "")))

    def to_json(self) -> dict[str, Any]:
        return {
            "v": COPY_FORMAT,
            "size": self.size,
            "root": self.root,
            "signed_at": self.signed_at.isoformat(timespec="microseconds"),
            "signature": self.signature,
            "public_key": self.public_key,
        }

    def line(self) -> str:
        """One line of a checkpoint file (no newline)."""
        return json.dumps(self.to_json(), separators=(",", ":"))

    def signed_by(self, public_key: bytes) -> bool:
        """True when the Ed25519 signature verifies with `public_key`."""
        message = checkpoint_message(size=self.size, root=self.root, signed_at=self.signed_at)
        return verify(public_key, bytes.fromhex(self.signature), message)

    def describe(self) -> str:
        stamp = self.signed_at.isoformat(timespec="seconds")
        return f"checkpoint of size {self.size} signed {stamp} (root {self.root[:16]}…)"


def _is_hex(value: str) -> bool:
    try:
        bytes.fromhex(value)
    except ValueError:
        return False
    return True


def parse_checkpoints(text: str, *, source: str) -> list[SignedCheckpoint]:
    """Checkpoints in `text`: one JSON object (possibly spread over lines) or JSON lines."""
    stripped = text.strip()
    if not stripped:
        raise CheckpointFileError(f"{source} holds no checkpoint")
    try:
        whole = json.loads(stripped)
    except ValueError:
        whole = None
    if whole is not None:
        items = whole if isinstance(whole, list) else [whole]
        try:
            return [SignedCheckpoint.from_json(item) for item in items]
        except ValueError as exc:
            raise CheckpointFileError(f"{source}: {exc}") from None
    heads = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            heads.append(SignedCheckpoint.from_json(json.loads(line)))
        except ValueError as exc:
            raise CheckpointFileError(f"{source} line {number}: {exc}") from None
    return heads


def read_checkpoints(path: Path) -> list[SignedCheckpoint]:
    """The checkpoints kept in the file `path` (see `parse_checkpoints`)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "it is not UTF-8 text"
        raise CheckpointFileError(f"cannot read {path}: {reason}") from None
    return parse_checkpoints(text, source=str(path))


def append_checkpoint(path: Path, head: SignedCheckpoint) -> None:
    """Append `head` as one JSON line to `path` and flush it to disk before returning."""
    with path.open("a", encoding="utf-8") as fh:
        fh.write(head.line() + "\n")
        fh.flush()
        os.fsync(fh.fileno())
