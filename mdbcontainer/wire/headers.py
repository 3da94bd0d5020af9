"""The container's own message headers (``x-mdb-*``) and the reasons a backout names, written once.

A failed message carries its failure context in headers the container sets
and reads again in three layers: the wire (``delays``: the copy that waits
out a redelivery delay, ``delivery``: the headers a handler never sees), the
pipeline (``backout``: the copy on a backout queue, ``single``: the copy on an
expiry queue) and the operations (``dlq``: what ``mdb dlq`` shows and strips
before a replay). The wire is the lowest of them, so the names live here and
the layers above import them; a header renamed in one place only would leave
``mdb dlq`` reading a header nobody writes any more.

The names and values are user-visible (CONTRACT.md: the headers on a
backed-out message), so they never change; only where they are written does.
"""

from __future__ import annotations

#: Every header of the container's own starts with this; a replay removes them all.
PREFIX = "x-mdb-"

# -- on a backed-out message (and, but the reason, on a copy waiting out a delay) --------------

#: Why the message left its queue: one of the ``REASON_*`` below, or a handler's ``ctx.move_to`` reason.
BACKOUT_REASON = "x-mdb-backout-reason"
#: The queue the message failed on, where ``mdb dlq replay`` sends it back.
ORIGINAL_DESTINATION = "x-mdb-original-destination"
#: The port whose handler failed it.
PORT = "x-mdb-port"
#: The failed deliveries so far (equal to the threshold for a poison message).
REDELIVERY_COUNT = "x-mdb-redelivery-count"
#: The last failure: type, message and a bounded traceback (``support.failures.exception_text``).
EXCEPTION = "x-mdb-exception"
#: When it failed, ISO 8601 in UTC.
FAILED_AT = "x-mdb-failed-at"

#: The headers of a failure, in the order they are written.
FAILURE_HEADERS = (ORIGINAL_DESTINATION, PORT, REDELIVERY_COUNT, EXCEPTION, FAILED_AT)

# -- on a copy waiting out a redelivery delay (wire.delays) ------------------------------------

#: The wait it came back from: marks a redelivery the broker does not flag.
WAITED = "x-mdb-waited"
#: Its expiry: the broker drops ``expiration`` when it dead-letters the copy back.
WAIT_EXPIRES_AT = "x-mdb-expires-at"
#: What a message back from its wait carries and its handler never sees.
WAIT_HEADERS = frozenset({WAITED, WAIT_EXPIRES_AT, *FAILURE_HEADERS})

# -- on a copy on an expiry queue --------------------------------------------------------------

#: When the container found the message expired (an ``expiry_queue`` copy).
EXPIRED_AT = "x-mdb-expired-at"

# -- the broker's own, read but never written by the container ---------------------------------

#: RabbitMQ's count of earlier deliveries (quorum queues, and every queue of the embedded broker).
BROKER_DELIVERY_COUNT = "x-delivery-count"

# -- the reasons of BACKOUT_REASON the container itself gives ----------------------------------

#: Delivered ``backout_threshold`` times without being handled.
REASON_THRESHOLD = "backout-threshold"
#: The body cannot become the handler's argument (``message.InvalidBody``).
REASON_INVALID = "invalid-body"
#: A once-only port met a message without an AMQP ``message_id``.
REASON_MISSING_ID = "missing-message-id"
#: Every reason the container gives (a handler's ``ctx.move_to`` may give any other).
REASONS = (REASON_THRESHOLD, REASON_INVALID, REASON_MISSING_ID)
