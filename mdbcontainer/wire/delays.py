"""Redelivery delays kept by the broker: a failed message waits on a wait queue, not in a consumer.

With ``[queues.Q] redelivery_delay`` set, a failed message leaves ``Q`` to
wait, and the port's consumers go on with the next messages at once. The
wait is a durable queue per distinct wait, ``Q.wait.<duration>`` (``Q.wait.1s``,
``Q.wait.2s``, ...), declared with a per-queue TTL and dead-lettering back to
``Q`` through the default exchange: the broker keeps the wait (a container
crash or a broker restart loses nothing), and no plugin is needed. One queue
per wait, not one queue with a TTL per message: a classic queue expires
messages at its head only, so a long wait would hold a short one behind it.

A move is a confirmed, mandatory copy on the wait queue first and the
acknowledgment of the original after (as a backout is): a crash between the
two (the broker's confirm of a persistent message waits for its disk, so the
window is not small) leaves one extra copy. The original comes back at once;
if it is then handled, the copy is absorbed by the dedup table on once-only
ports; if it fails again, the copy is *stale*: its message has failed more
often than when it left (``x-mdb-redelivery-count``), another copy carries
it on, and the pipeline acknowledges the stale one, on its first delivery,
without running it, so an extra copy neither runs nor counts failures of its
own. (Only a copy's first delivery can be stale: a failure is counted before
the move, so a copy the broker redelivers after a crash may be the last one.)
That holds because a copy carries the failures the database counted with its
own failure, not its delivery's count plus one: two copies delivered before
either failed (a producer's retry, an original redelivered beside its copy)
began with the same count, and had both carried it, both would come back
stale and the message would be gone.
The copy carries the failure context (``x-mdb-redelivery-count``,
``x-mdb-exception``, ...) and, for a message with a TTL, its expiry in
``x-mdb-expires-at``, because the broker drops ``expiration`` when it
dead-letters: a message whose time runs out while it waits comes back
expired and takes the expiry path, never a handler. ``delivery.envelope``
removes those headers again, so the handler sees the producer's headers.

The embedded broker keeps the same queues in its file and dead-letters a
TTL queue's due messages even with nobody consuming it (``embedded/messages.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from ..errors import PublishError
from ..settings import QueueSettings, format_duration
from ..support import clock
from ..support.crash import crash_point
from ..support.outgoing import Outgoing
from .delivery import Delivery
from .headers import (
    EXCEPTION,
    FAILED_AT,
    ORIGINAL_DESTINATION,
    PORT,
    REDELIVERY_COUNT,
    WAIT_EXPIRES_AT,
    WAIT_HEADERS,
    WAITED,
)

log = logging.getLogger("mdbcontainer.delays")

#: A queue never gets more wait queues than this (a backoff of 1.01 would ask for hundreds);
#: failures past it wait ``redelivery_delay_max``.
MAX_LEVELS = 32
# The AMQP timestamp has whole seconds: a copy waits that much (and a little) past its expiry,
# so that it comes back certainly expired (the pipeline allows the same grain before it expires one).
_EXPIRY_GRAIN_MS = 1100


def wait_after(q: QueueSettings, failures: int) -> timedelta:
    """The wait after ``failures`` failed deliveries: delay x backoff^(failures-1), capped, in ms."""
    if q.redelivery_delay <= timedelta(0) or failures <= 0:
        return timedelta(0)
    cap = q.redelivery_delay_max.total_seconds()
    if failures > MAX_LEVELS:
        seconds = cap
    else:
        seconds = min(q.redelivery_delay.total_seconds() * q.redelivery_backoff ** (failures - 1), cap)
    return timedelta(milliseconds=max(1, round(seconds * 1000)))


def waits(q: QueueSettings) -> list[timedelta]:
    """Every distinct wait a failed message of the queue can get, shortest first.

    Failures that reach the backout threshold go to the backout queue, not to
    a wait: with a threshold of N, failures 1 to N-1 wait. With no threshold
    the waits grow until the cap.
    """
    if q.redelivery_delay <= timedelta(0):
        return []
    last = q.backout_threshold - 1 if q.backout_threshold else MAX_LEVELS + 1
    return sorted({wait_after(q, failures) for failures in range(1, min(last, MAX_LEVELS + 1) + 1)})


def wait_queue(queue: str, wait: timedelta) -> str:
    """The plain name of the queue where messages of ``queue`` wait ``wait``: ``ORDERS.wait.2s``."""
    return f"{queue}.wait.{format_duration(wait)}"


def wait_arguments(queue: str, wait: timedelta, quorum: bool) -> dict[str, Any]:
    """Declare arguments of a wait queue: its TTL, and dead-lettering back to ``queue``.

    A quorum queue's waits are quorum queues too (replicated like it), with
    at-least-once dead-lettering, which RabbitMQ allows with ``reject-publish`` only.
    """
    args: dict[str, Any] = {
        "x-message-ttl": round(wait.total_seconds() * 1000),
        "x-dead-letter-exchange": "",
        "x-dead-letter-routing-key": queue,
    }
    if quorum:
        args.update({"x-queue-type": "quorum", "x-dead-letter-strategy": "at-least-once",
                     "x-overflow": "reject-publish"})
    return args


def wait_queues(queue: str, q: QueueSettings) -> dict[str, dict[str, Any]]:
    """The wait queues of ``queue`` (name to declare arguments); empty without a delay."""
    return {wait_queue(queue, wait): wait_arguments(queue, wait, q.quorum) for wait in waits(q)}


def came_back(delivery: Delivery) -> bool:
    """Whether the delivery returned from a wait: a redelivery, though the broker's flag is off."""
    return delivery.header(WAITED) is not None


def left_after(delivery: Delivery) -> int | None:
    """The failures a copy's message had when the copy left to wait, on the copy's first delivery.

    None for anything else, a copy the broker redelivers included: that one
    may be the only copy left (its process died after its failure was counted,
    before its move), so it is never taken for an extra one.
    """
    if delivery.redelivered or not came_back(delivery):
        return None
    try:
        return int(delivery.header(REDELIVERY_COUNT))
    except (TypeError, ValueError):
        return None


def carried_failure(delivery: Delivery) -> str | None:
    """The last failure's text a message brought back from its wait (None for any other)."""
    return delivery.header(EXCEPTION) if came_back(delivery) else None


class Delays:
    """Moves a port's failed deliveries to wait out their queue's redelivery delay."""

    def __init__(self, port: str, queue: str, settings: QueueSettings,
                 publish: Callable[[Outgoing], None], discard: Callable[[Delivery], None]) -> None:
        self.port = port
        self.queue = queue
        self.settings = settings
        self._publish = publish
        self._discard = discard

    def move(self, delivery: Delivery, failures: int, exception: str) -> bool:
        """Send the failed delivery to wait, then acknowledge it; False: requeue it at once instead.

        The failure is already counted, and ``failures`` is the count the database
        returned for it (the copy's ``x-mdb-redelivery-count``, see above). A wait
        queue the broker cannot take the copy on (deleted by an operator, refused)
        is logged, and the message goes back to its queue at once: never dropped.
        """
        wait = wait_after(self.settings, failures)
        if not wait:
            return False
        crash_point("before-wait")
        if delivery.postpone(wait):  # the transport keeps the wait on the message (SQS): no copy
            return True
        try:
            self._publish(self.copy(delivery, wait, failures, exception))
        except PublishError as exc:
            log.warning("port %s: message %s could not wait %s (%s); requeued at once", self.port,
                        delivery.message_id, format_duration(wait), exc)
            return False
        crash_point("mid-wait")
        self._discard(delivery)
        return True

    def copy(self, delivery: Delivery, wait: timedelta, failures: int, exception: str) -> Outgoing:
        """The delivery bound for its wait queue: body, id and properties as they came, plus context."""
        now = clock.now()
        headers = {k: v for k, v in delivery.headers.items() if k not in WAIT_HEADERS}
        headers.update({
            WAITED: format_duration(wait),
            ORIGINAL_DESTINATION: self.queue,
            PORT: self.port,
            REDELIVERY_COUNT: failures,
            EXCEPTION: exception,
            FAILED_AT: now.isoformat(),
        })
        expires_at = delivery.expires_at()
        if expires_at is not None:
            headers[WAIT_EXPIRES_AT] = expires_at.isoformat()
        out = delivery.copy_to(wait_queue(self.queue, wait), headers, replace=True)
        if expires_at is not None:  # the broker sends it back when its time is up, expired
            left = (expires_at - now) / timedelta(milliseconds=1) + _EXPIRY_GRAIN_MS
            out.properties["expiration"] = str(max(0, round(left)))
        return out
