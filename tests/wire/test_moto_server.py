"""The tests' SQS server (tests/moto_server.py): moto's delete takes the lock its sends append under.

moto's own ``Queue.delete_message`` rebuilds a queue's message list outside
that lock, and a message sent meanwhile could vanish from the rebuilt list:
to the SQS tests, a loss of the container's (sent, never received, nothing in
flight, nothing ready).
"""

from __future__ import annotations

import threading
import time

from moto.sqs.models import Message, Queue

from tests import moto_server


def test_a_delete_waits_for_a_send_that_holds_the_queues_lock() -> None:
    assert moto_server.Queue is Queue
    queue = Queue("race", "us-east-1", "123456789012")
    message = Message("m-1", "body")
    queue._messages.append(message)
    message.mark_received()
    deleted = threading.Event()

    def delete() -> None:
        queue.delete_message(message.receipt_handle)
        deleted.set()

    with queue._messages_lock:  # a send appending now
        worker = threading.Thread(target=delete)
        worker.start()
        time.sleep(0.2)
        assert not deleted.is_set(), "the delete rebuilt the list while a send held the lock"
    worker.join(5)
    assert deleted.is_set() and queue._messages == []
