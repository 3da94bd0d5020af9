"""Durable redelivery counts: how many times a message failed, across processes.

RabbitMQ classic queues carry no delivery count, so the count lives in the
container's database, keyed by (queue, message id). Nothing is written on a
first delivery; a redelivered one opens an attempt before the handler runs,
and a failure or a graceful hand-back closes it. An attempt opened and never
closed is a delivery the process died in, so a message that kills the
container is counted too and ends in the backout queue instead of looping:

    earlier failed deliveries = recorded failures + (earlier deliveries - closed ones)
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy import delete

from ..support.logs import mask_secrets
from .store import Store, utcnow

CRASHED = "the container process died during this delivery (killed, crashed or lost its broker connection)"
MAX_TRACEBACK = 4000



@dataclass(frozen=True)
class Attempt:
    """What the durable count says of the delivery about to run."""

    count: int
    last_exception: str | None


def exception_text(exc: BaseException) -> str:
    """Type, message and a bounded traceback, kept across processes in ``x-mdb-exception``."""
    # Masked: the header is printed by mdb dlq show, and a handler's error may carry a URL.
    text = mask_secrets("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
    if len(text) > MAX_TRACEBACK:
        text = text[:200] + "\n...\n" + text[-(MAX_TRACEBACK - 210) :]
    return text.strip()


class DeliveryCounter:
    """Durable per-message delivery counts (one round trip, only off the first-delivery path)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.table = store.tables.delivery

    def _upsert(self, queue: str, message_id: str, **increments: int | str) -> Any:
        t = self.table
        values = {"queue": queue, "message_id": message_id, "opened": 0, "closed": 0,
                  "failures": 0, "updated_at": utcnow()}
        extra = {k: v for k, v in increments.items() if k == "last_exception"}
        counts = {k: v for k, v in increments.items() if k != "last_exception"}
        values.update(counts)
        values.update(extra)
        stmt = self.store.insert(t).values(values)
        update = {k: t.c[k] + v for k, v in counts.items()}
        update.update({k: stmt.excluded[k] for k in extra})
        update["updated_at"] = stmt.excluded.updated_at
        return stmt.on_conflict_do_update(
            index_elements=[t.c.queue, t.c.message_id], set_=update
        ).returning(t.c.opened, t.c.closed, t.c.failures, t.c.last_exception)

    def open(self, queue: str, message_id: str) -> Attempt:
        """Record that a delivery starts and return its count of earlier failed deliveries.

        Only redeliveries are recorded (the broker flags them), so the first
        delivery was never recorded and counts as opened.
        """
        with self.store.engine.begin() as conn:
            opened, closed, failures, last = conn.execute(
                self._upsert(queue, message_id, opened=1)
            ).one()
        earlier = opened
        crashed = max(0, earlier - closed)
        return Attempt(failures + crashed, last if not crashed else CRASHED)

    def fail(self, queue: str, message_id: str, text: str) -> None:
        """Record a failed delivery (durably, before the message is requeued)."""
        with self.store.engine.begin() as conn:
            conn.execute(self._upsert(queue, message_id, failures=1, closed=1, last_exception=text))

    def hand_back(self, queue: str, message_ids: list[str]) -> None:
        """Record deliveries returned unprocessed by a graceful stop, so they do not count."""
        if not message_ids:
            return
        with self.store.engine.begin() as conn:
            for message_id in message_ids:
                conn.execute(self._upsert(queue, message_id, closed=1))

    def reset(self, queue: str, message_id: str) -> None:
        """Forget a message's count (a replay from the backout queue starts again at 0)."""
        with self.store.engine.begin() as conn:
            conn.execute(
                delete(self.table).where(
                    self.table.c.queue == queue, self.table.c.message_id == message_id
                )
            )


def redelivery_wait(delay: timedelta, backoff: float, cap: timedelta, failures: int) -> float:
    """Seconds to hold a failed message before it is offered again (exponential when backoff > 1)."""
    if delay <= timedelta(0) or failures <= 0:
        return 0.0
    seconds = delay.total_seconds() * (backoff ** (failures - 1))
    return min(seconds, cap.total_seconds())
