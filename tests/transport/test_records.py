"""A signed submission crosses the wire in its header alone, and comes back the same."""

from __future__ import annotations

from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict

from zoo_gym.core.protocol import PAYLOAD, SUBMISSION, TRAIN_METRICS, SignedSubmission
from zoo_gym.proto.v1 import federation_pb2 as pb
from zoo_gym.transport.flower_internals import set_task_identity
from zoo_gym.transport.records import header_of, submission_of_header, unpack_reply

SUB = SignedSubmission("c1", 2, "v0001", "m1", b"\x01" * 16, "ab" * 32, 100, b"\x09" * 64)
AUTH = pb.Auth(contributor_id="c1", timestamp_ms=5, signature=b"\x02" * 64, nonce=b"\x03" * 16)


def test_a_submission_round_trips_through_its_header_bytes() -> None:
    # Execute
    wire = header_of(SUB, AUTH, b"reply").SerializeToString()
    back = submission_of_header(pb.SubmissionHeader.FromString(wire))

    # Assert: the same statement, and the header's bytes as version 1 of the protocol has them
    assert back == SUB and back.statement() == SUB.statement()
    assert wire == (
        b"\n\x5a"  # field 1 (auth), 90 bytes
        + AUTH.SerializeToString()
        + b"\x12\x02m1\x18\x02\x22\x05v0001\x2a\x10"
        + b"\x01" * 16
        + b"\x32\x40"
        + b"ab" * 32
        + b"\x38\x64\x42\x40"
        + b"\x09" * 64
        + b"\x4a\x05reply"
    )


def test_unpacking_a_reply_leaves_the_signed_fields_out_of_the_rest() -> None:
    # Prepare
    set_task_identity(run_id=1, node_id=0, task_id=1)  # as `Coordinator.run` sets them
    record = ConfigRecord({**SUB.to_record(), PAYLOAD: b"ZGDE"})
    metrics = MetricRecord({"num_examples": 3.0})
    reply = Message(
        RecordDict({SUBMISSION: record, TRAIN_METRICS: metrics}),
        dst_node_id=1,
        message_type="train",
    )

    # Execute
    sub, payload, rest = unpack_reply(reply)

    # Assert
    assert (sub, payload) == (SUB, b"ZGDE")
    assert SUBMISSION not in rest and rest.metric_records[TRAIN_METRICS]["num_examples"] == 3.0
