"""The backout queue (BOQNAME): moving a message off its queue for a person to look at.

A message leaves its queue for the backout queue when it was delivered
``backout_threshold`` times, when its body is poison the container can see
(``invalid-body``), or when a once-only port cannot identify it. The move is
a confirmed copy first and the acknowledgment after, so a crash in between
duplicates the message on the backout queue and never loses it. The copy
keeps body, id and properties and carries the ``x-mdb-*``
headers of the README (Headers on a backed-out message). (How many times a
message failed is kept in ``state/counts.py``.)
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

from ..state.store import utcnow
from ..support.crash import crash_point
from ..support.outgoing import Outgoing
from ..wire.delivery import Delivery
from ..wire.headers import (
    BACKOUT_REASON,
    EXCEPTION,
    FAILED_AT,
    ORIGINAL_DESTINATION,
    PORT,
    PREFIX,
    REDELIVERY_COUNT,
)


def backout_headers(
    headers: dict[str, Any],
    *,
    reason: str,
    destination: str,
    port: str,
    count: int,
    exception: str | None,
    failed_at: datetime | None = None,
) -> dict[str, Any]:
    """The original headers plus the ``x-mdb-*`` failure headers (README: Headers on a backed-out message)."""
    out = {k: v for k, v in headers.items() if not k.startswith(PREFIX)}
    out.update({
        BACKOUT_REASON: reason,
        ORIGINAL_DESTINATION: destination,
        PORT: port,
        REDELIVERY_COUNT: count,
        EXCEPTION: exception or "",
        FAILED_AT: (failed_at or utcnow()).isoformat(),
    })
    return out


class Backout:
    """Moves a port's deliveries to its backout queue (or, for ``ctx.move_to``, another queue)."""

    def __init__(self, port: str, destination: str, backout_queue: str,
                 publish: Callable[[Outgoing], None], discard: Callable[[Delivery], None]) -> None:
        self.port = port
        self.destination = destination
        self.queue = backout_queue
        self._publish = publish
        self._discard = discard

    def copy(self, delivery: Delivery, queue: str, reason: str, count: int,
             exception: str | None) -> Outgoing:
        """The delivery bound for ``queue`` with the failure headers."""
        headers = backout_headers(delivery.headers, reason=reason, destination=self.destination,
                                  port=self.port, count=count, exception=exception)
        return delivery.copy_to(queue, headers, replace=True)

    def move(self, delivery: Delivery, reason: str, count: int, exception: str | None) -> None:
        """Confirmed copy on the backout queue first, then the original leaves its queue."""
        self._publish(self.copy(delivery, self.queue, reason, count, exception))
        crash_point("mid-backout")
        self._discard(delivery)
