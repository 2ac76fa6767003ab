"""`Mailbox.close` wakes the Grid's wait for replies and every long poll at once, for good."""

from __future__ import annotations

import threading
import time

from flwr.app import Message, RecordDict

from zoo_gym.transport.mailbox import Mailbox, PendingTask


def test_close_wakes_the_wait_for_replies_and_long_polls() -> None:
    # Prepare: the round loop waits 60 s for a reply, a contributor long-polls for 60 s
    box = Mailbox()
    waiters = [
        threading.Thread(target=box.wait_replies, args=({"m1"}, 60.0)),
        threading.Thread(target=box.take, args=(7, 60.0)),
    ]
    for w in waiters:
        w.start()
    time.sleep(0.2)

    # Execute
    began = time.monotonic()
    box.close()
    for w in waiters:
        w.join(timeout=10)

    # Assert: both returned at once; a task put afterwards is not handed out
    assert not any(w.is_alive() for w in waiters)
    assert time.monotonic() - began < 5
    message = Message(RecordDict(), dst_node_id=7, message_type="train")
    box.put(7, PendingTask(message, 1, "v0000", 0))
    began = time.monotonic()
    assert box.take(7, 30.0) is None
    box.wait_replies({"m2"}, 30.0)
    assert time.monotonic() - began < 5
