"""The reply record a ClientApp produces, as both Grids take it apart.

A reply carries the signed statement and the payload in one ConfigRecord
(`SUBMISSION`). The payload travels separately (streamed in chunks over gRPC,
spooled to a file in-process), so both Grids split it off the same way.
"""

from __future__ import annotations

from flwr.app import ConfigRecord, Message, RecordDict

from zoo_gym.core.protocol import PAYLOAD, SUBMISSION, SignedSubmission


def split_payload(reply: Message) -> tuple[bytes, RecordDict, ConfigRecord]:
    """(payload, the reply content without it, the full submission record)."""
    record = reply.content.config_records[SUBMISSION]
    payload = bytes(record[PAYLOAD])  # type: ignore[arg-type]
    stripped = ConfigRecord({k: v for k, v in record.items() if k != PAYLOAD})
    return payload, RecordDict({**dict(reply.content.items()), SUBMISSION: stripped}), record


def submission_of(record: ConfigRecord) -> SignedSubmission:
    """The signed statement inside a ClientApp's reply record."""
    return SignedSubmission(
        contributor_id=str(record["contributor_id"]),
        round=int(record["round"]),  # type: ignore[arg-type]
        base_version=str(record["base_version"]),
        message_id=str(record["message_id"]),
        nonce=bytes(record["nonce"]),  # type: ignore[arg-type]
        payload_sha256=str(record["payload_sha256"]),
        payload_size=int(record["payload_size"]),  # type: ignore[arg-type]
        signature=bytes(record["signature"]),  # type: ignore[arg-type]
    )
