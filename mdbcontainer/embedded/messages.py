"""Messages: publish, claim the head, ack, requeue in place, dead-letter.

A delivery *claims* its row instead of removing it, so a message is never
only in a consumer's memory: ``ack`` deletes the row, a requeue unclaims it
where it stands (the head of the queue, as RabbitMQ requeues), and a claim
whose owner died can be released (see claims.py).
"""

from __future__ import annotations

import uuid

from ..support import clock
from .errors import BASIC_PUBLISH
from .payload import Payload, as_delivery, dumps, expires_at, loads, mark_death, priority
from .routing import RoutingStore
from .schema import immediate

# The queue's own TTL caps a message's expiration; the priority is clamped
# to the queue's x-max-priority; a missing queue inserts nothing.
_INSERT_MESSAGE = """
    INSERT INTO broker_messages (queue, priority, payload, published_at, expires_at)
    SELECT name, MAX(0, MIN(?, max_priority)), ?, ?,
           CASE WHEN message_ttl IS NULL THEN ?
                ELSE MIN(COALESCE(?, 1e300), ? + message_ttl / 1000.0) END
    FROM broker_queues WHERE name = ?"""

_NEXT_READY = """
    SELECT id FROM broker_messages WHERE queue = ? AND claimed_by IS NULL
    ORDER BY priority DESC, id LIMIT 1"""

_CLAIM = f"""
    UPDATE broker_messages
    SET claimed_by = ?, claim = ?, claimed_at = ?, delivery_count = delivery_count + 1
    WHERE id = ({_NEXT_READY})
    RETURNING id, payload, delivery_count, redelivered"""

_TAKE = f"""
    DELETE FROM broker_messages WHERE id = ({_NEXT_READY})
    RETURNING id, payload, delivery_count + 1, redelivered"""

# Queues with a queue-level TTL (redelivery wait queues among them) that hold a due message.
_DUE_QUEUES = """
    SELECT q.name FROM broker_queues q
    WHERE q.message_ttl IS NOT NULL AND EXISTS (
        SELECT 1 FROM broker_messages m
        WHERE m.queue = q.name AND m.expires_at <= ? AND m.claimed_by IS NULL)"""

_UNCLAIM = """
    UPDATE broker_messages
    SET claimed_by = NULL, claim = NULL, claimed_at = NULL, redelivered = 1,
        delivery_count = MAX(0, delivery_count - ?)
    WHERE id = ? AND claim = ?"""


class MessageStore(RoutingStore):
    """Message operations: the hot path of publish, claim and settle."""

    def _insert(self, queue: str, payload: Payload, raw: str, now: float) -> int:
        props = payload.get("properties") or {}
        expires = expires_at(props, now)
        return self.db.execute(
            _INSERT_MESSAGE,
            (priority(props), raw, now, expires, expires, now, queue),
        ).rowcount

    def put(self, queue: str, payload: Payload) -> int:
        """Store into one queue; 0 if the queue does not exist (dropped)."""
        with self.lock:
            return self._insert(queue, payload, dumps(payload), clock.time())

    def publish(self, exchange: str, routing_key: str, payload: Payload) -> int:
        """Route and store atomically; return how many queues took it."""
        raw = dumps(payload)
        now = clock.time()
        with self.lock:
            if not exchange:
                return self._insert(routing_key, payload, raw, now)
            with immediate(self.db):
                queues = self.route(exchange, routing_key, BASIC_PUBLISH)
                return sum(self._insert(q, payload, raw, now) for q in queues)

    def claim(self, queue: str, owner: str, auto_ack: bool) -> Payload | None:
        """Claim (or, with auto_ack, take) the head of `queue`.

        A lock-free read first, so that polling an empty queue never takes
        the write lock; then expiry and the claim in one IMMEDIATE
        transaction.
        """
        with self.lock:
            if (
                self.db.execute(
                    "SELECT 1 FROM broker_messages WHERE queue = ? AND claimed_by IS NULL LIMIT 1",
                    (queue,),
                ).fetchone()
                is None
            ):
                return None
            claim = uuid.uuid4().hex
            now = clock.time()
            with immediate(self.db) as db:
                self._expire(queue, now)
                if auto_ack:
                    row = db.execute(_TAKE, (queue,)).fetchone()
                else:
                    row = db.execute(_CLAIM, (owner, claim, now, queue)).fetchone()
        return None if row is None else as_delivery(row, claim)

    def expire_due(self) -> int:
        """Dead-letter the due messages of every queue with a TTL, consumed or not.

        RabbitMQ expires a TTL queue's messages with nobody consuming it, and a
        redelivery wait queue (``mdbcontainer/wire/delays.py``) never has a consumer:
        its messages must go back to their queue when their wait is up. One
        indexed read when nothing is due; the move is one transaction.
        """
        with self.lock:
            now = clock.time()
            due = [row[0] for row in self.db.execute(_DUE_QUEUES, (now,)).fetchall()]
            if not due:
                return 0
            with immediate(self.db):
                for queue in due:
                    self._expire(queue, now)
        return len(due)

    def _expire(self, queue: str, now: float) -> None:
        rows = self.db.execute(
            "DELETE FROM broker_messages WHERE queue = ? AND expires_at IS NOT NULL"
            " AND expires_at <= ? AND claimed_by IS NULL RETURNING id, payload",
            (queue, now),
        ).fetchall()
        if rows:
            self._dead_letter(queue, sorted(rows), "expired", now)

    def _dead_letter(
        self, queue: str, rows: list[tuple[int, str]], reason: str, now: float
    ) -> None:
        """Republish removed rows to the queue's dead-letter exchange, if any."""
        args = self.queue_arguments(queue) or {}
        dlx = args.get("x-dead-letter-exchange")
        if dlx is None:
            return
        for _, raw in rows:
            payload: Payload = loads(raw)
            info = payload.get("properties", {}).get("delivery_info") or {}
            key = args.get("x-dead-letter-routing-key") or info.get("routing_key") or ""
            mark_death(payload, queue, reason)
            payload["properties"]["delivery_info"] = {"exchange": dlx, "routing_key": key}
            body = dumps(payload)
            for target in self.route(dlx, key, None):
                self._insert(target, payload, body, now)

    def ack(self, tags: list[tuple[int, str]]) -> None:
        with self.lock:
            self.db.executemany("DELETE FROM broker_messages WHERE id = ? AND claim = ?", tags)

    def requeue(self, tags: list[tuple[int, str]], counted: bool) -> None:
        """Unclaim in place (head of the queue).

        `counted` False undoes the claim's increment of delivery_count: a
        message handed back unprocessed (channel close, recover) was not a
        failed delivery.
        """
        with self.lock:
            self.db.executemany(
                _UNCLAIM, [(0 if counted else 1, row, claim) for row, claim in tags]
            )

    def reject(self, tags: list[tuple[int, str]]) -> None:
        """Delete rejected rows, dead-lettering them if their queue says so."""
        now = clock.time()
        with self.lock, immediate(self.db) as db:
            for row, claim in tags:
                found = db.execute(
                    "DELETE FROM broker_messages WHERE id = ? AND claim = ?"
                    " RETURNING queue, payload",
                    (row, claim),
                ).fetchone()
                if found is not None:
                    self._dead_letter(found[0], [(row, found[1])], "rejected", now)
