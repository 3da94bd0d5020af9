"""moto's SQS server for the tests (``python -m tests.moto_server -p PORT``), one race of moto's closed.

moto 5's ``Queue.delete_message`` rebuilds the queue's message list without
the lock that ``add_message`` appends under: a message sent to a queue while
a consumer deletes another from it can be dropped from the rebuilt list. It
was sent (SendMessage answered), so nothing is in flight, nothing is ready,
and no consumer ever sees it: to the SQS tests, a loss of the container's
(tests/wire/test_moto_server.py shows the race); real SQS has no such race. The delete is
made to hold the same lock, a reentrant one (a Condition on an RLock).
"""

from __future__ import annotations

from typing import Any

from moto.sqs.models import Queue

_delete_message = Queue.delete_message


def _delete_message_locked(self: Any, receipt_handle: str) -> None:
    with self._messages_lock:
        _delete_message(self, receipt_handle)


Queue.delete_message = _delete_message_locked  # type: ignore[method-assign]

if __name__ == "__main__":
    from moto.server import main

    main()
