"""A ClientApp's reply as both Grids take it apart, and the signed submission on the wire.

A reply carries the signed submission and the payload in one ConfigRecord (`SUBMISSION`),
training metrics beside it. The payload travels separately (streamed in chunks over gRPC,
spooled to a file in-process) and the signed fields travel once, in the `SubmissionHeader`:
the Flower reply sent with them is the rest of the content, without the submission record.
"""

from __future__ import annotations

from flwr.app import Message, RecordDict

from zoo_gym.core.protocol import SUBMISSION, SignedSubmission, payload_of
from zoo_gym.proto.v1 import federation_pb2 as pb


def unpack_reply(reply: Message) -> tuple[SignedSubmission, bytes, RecordDict]:
    """(the signed submission, the payload, the rest of the reply's content).

    Raises MalformedRecord when the submission record lacks a field or holds a wrong type.
    """
    record = reply.content.config_records[SUBMISSION]
    rest = RecordDict({k: v for k, v in reply.content.items() if k != SUBMISSION})
    return SignedSubmission.from_record(record), payload_of(record), rest


def header_of(sub: SignedSubmission, auth: pb.Auth, flower_reply: bytes) -> pb.SubmissionHeader:
    """The header that opens an upload of `sub` (the contributor is the one `auth` names)."""
    return pb.SubmissionHeader(
        auth=auth,
        message_id=sub.message_id,
        round=sub.round,
        base_version=sub.base_version,
        nonce=sub.nonce,
        payload_sha256=sub.payload_sha256,
        payload_size=sub.payload_size,
        signature=sub.signature,
        flower_reply=flower_reply,
    )


def submission_of_header(header: pb.SubmissionHeader) -> SignedSubmission:
    """Inverse of `header_of`: the signed submission an upload claims to carry."""
    return SignedSubmission(
        contributor_id=header.auth.contributor_id,
        round=header.round,
        base_version=header.base_version,
        message_id=header.message_id,
        nonce=header.nonce,
        payload_sha256=header.payload_sha256,
        payload_size=header.payload_size,
        signature=header.signature,
    )
