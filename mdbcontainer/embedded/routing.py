"""Exchanges, bindings and AMQP routing, persistent and shared by processes.

kombu's virtual transports keep bindings in process memory, so a queue
bound by one process is invisible to a publisher in another; here both are
rows, and routing reads them at publish time.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from amqp.exceptions import ChannelError

from .errors import EXCHANGE_DECLARE, EXCHANGE_DELETE, QUEUE_BIND, not_found, precondition
from .queue_rows import QueueStore
from .schema import immediate, json_args

EXCHANGE_TYPES = frozenset({"direct", "topic", "fanout"})


@lru_cache(maxsize=4096)
def topic_matches(binding_key: str, routing_key: str) -> bool:
    """AMQP topic match: ``*`` is one word, ``#`` zero or more words."""
    pattern = binding_key.split(".")
    words = routing_key.split(".")
    # reachable[j]: the pattern prefix seen so far can match words[:j]
    reachable = [True] + [False] * len(words)
    for part in pattern:
        if part == "#":
            for j in range(1, len(words) + 1):
                reachable[j] = reachable[j] or reachable[j - 1]
            continue
        nxt = [False] * (len(words) + 1)
        for j in range(1, len(words) + 1):
            nxt[j] = reachable[j - 1] and (part == "*" or part == words[j - 1])
        reachable = nxt
    return reachable[-1]


def binding_matches(kind: str, binding_key: str, routing_key: str) -> bool:
    """Whether a binding of an exchange of type `kind` takes `routing_key`."""
    if kind == "fanout":
        return True
    if kind == "topic":
        return topic_matches(binding_key, routing_key)
    return binding_key == routing_key


class RoutingStore(QueueStore):
    """Exchange and binding operations, and routing a publish to queues."""

    def exchange_type(self, exchange: str) -> str | None:
        row = self.db.execute(
            "SELECT type FROM broker_exchanges WHERE name = ?", (exchange,)
        ).fetchone()
        return None if row is None else str(row[0])

    def declare_exchange(
        self,
        exchange: str,
        kind: str,
        durable: bool,
        auto_delete: bool,
        arguments: dict[str, Any] | None,
    ) -> None:
        """Create the exchange, or check an existing one has the same type."""
        if kind not in EXCHANGE_TYPES:
            raise ChannelError(
                f"NOT_IMPLEMENTED - exchange type '{kind}' is not supported by the embedded broker",
                EXCHANGE_DECLARE,
                reply_code=540,
            )
        with self.lock, immediate(self.db) as db:
            db.execute(
                "INSERT OR IGNORE INTO broker_exchanges (name, type, durable,"
                " auto_delete, arguments) VALUES (?, ?, ?, ?, ?)",
                (exchange, kind, int(durable), int(auto_delete), json_args(arguments)),
            )
            current = self.exchange_type(exchange)
        if current != kind:
            raise precondition(
                f"inequivalent arg 'type' for exchange '{exchange}' in vhost '/':"
                f" received '{kind}' but current is '{current}'",
                EXCHANGE_DECLARE,
            )

    def has_exchange(self, exchange: str) -> bool:
        with self.lock:
            return self.exchange_type(exchange) is not None

    def delete_exchange(self, exchange: str, if_unused: bool = False) -> None:
        with self.lock, immediate(self.db) as db:
            used = db.execute(
                "SELECT 1 FROM broker_bindings WHERE exchange = ? LIMIT 1", (exchange,)
            ).fetchone()
            if if_unused and used:
                raise precondition(f"exchange '{exchange}' in vhost '/' in use", EXCHANGE_DELETE)
            db.execute("DELETE FROM broker_bindings WHERE exchange = ?", (exchange,))
            db.execute("DELETE FROM broker_exchanges WHERE name = ?", (exchange,))

    def bind(
        self, queue: str, exchange: str, routing_key: str, arguments: dict[str, Any] | None
    ) -> None:
        with self.lock, immediate(self.db) as db:
            if self.exchange_type(exchange) is None:
                raise not_found("exchange", exchange, QUEUE_BIND)
            if self.queue_arguments(queue) is None:
                raise not_found("queue", queue, QUEUE_BIND)
            db.execute(
                "INSERT OR IGNORE INTO broker_bindings (exchange, queue, routing_key,"
                " arguments) VALUES (?, ?, ?, ?)",
                (exchange, queue, routing_key, json_args(arguments)),
            )

    def unbind(self, queue: str, exchange: str, routing_key: str) -> None:
        with self.lock:
            self.db.execute(
                "DELETE FROM broker_bindings WHERE exchange = ? AND queue = ? AND routing_key = ?",
                (exchange, queue, routing_key),
            )

    def bindings(self, exchange: str | None = None) -> list[tuple[str, str, str]]:
        """(queue, exchange, routing key) rows, of one exchange or all."""
        sql = "SELECT queue, exchange, routing_key FROM broker_bindings"
        with self.lock:
            if exchange is None:
                rows = self.db.execute(sql + " ORDER BY exchange, queue").fetchall()
            else:
                rows = self.db.execute(sql + " WHERE exchange = ?", (exchange,)).fetchall()
        return [(str(q), str(e), str(k)) for q, e, k in rows]

    def exchanges(self) -> list[str]:
        with self.lock:
            return [r[0] for r in self.db.execute("SELECT name FROM broker_exchanges")]

    def route(self, exchange: str, routing_key: str, method: tuple[int, int] | None) -> list[str]:
        """Queues a publish reaches; a missing exchange raises if `method` is given."""
        if not exchange:
            return [routing_key]
        kind = self.exchange_type(exchange)
        if kind is None:
            if method is None:
                return []  # e.g. a missing dead-letter exchange: dropped
            raise not_found("exchange", exchange, method)
        rows = self.db.execute(
            "SELECT queue, routing_key FROM broker_bindings WHERE exchange = ? ORDER BY queue",
            (exchange,),
        ).fetchall()
        return sorted({q for q, key in rows if binding_matches(kind, key, routing_key)})
