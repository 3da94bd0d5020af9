"""Queues and their consumers, as rows every process sees.

The base of :class:`~mdbcontainer.embedded.broker_state.BrokerState`: it owns the
connection and the lock; routing, messages and claims build on it.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

from .errors import QUEUE_DECLARE, QUEUE_DELETE, precondition
from .schema import DEFAULT_BUSY_TIMEOUT, connect, immediate, json_args


class QueueStore:
    """Queue and consumer operations on one SQLite connection.

    Every public method holds a lock, because kombu lets other threads ack
    while the consuming thread polls on the same channel.
    """

    def __init__(
        self,
        path: str,
        busy_timeout: float = DEFAULT_BUSY_TIMEOUT,
        synchronous: str = "NORMAL",
    ) -> None:
        self.path = path
        self.lock = threading.RLock()
        self.db = connect(path, busy_timeout, synchronous)

    def close(self) -> None:
        with self.lock:
            self.db.close()

    def queue_arguments(self, queue: str) -> dict[str, Any] | None:
        row = self.db.execute(
            "SELECT arguments FROM broker_queues WHERE name = ?", (queue,)
        ).fetchone()
        return None if row is None else json.loads(row[0])

    def has_queue(self, queue: str) -> bool:
        with self.lock:
            return self.queue_arguments(queue) is not None

    def declare_queue(
        self,
        queue: str,
        arguments: dict[str, Any] | None,
        exclusive_owner: str | None = None,
        auto_delete: bool = False,
    ) -> None:
        """Create the queue, or check an existing one has the same arguments.

        INSERT OR IGNORE makes concurrent declares from several processes
        safe; a different set of arguments is refused as RabbitMQ does.
        """
        args = json.loads(json_args(arguments))
        max_priority = int(args.get("x-max-priority") or 0)
        ttl = args.get("x-message-ttl")
        with self.lock, immediate(self.db) as db:
            db.execute(
                "INSERT OR IGNORE INTO broker_queues (name, arguments, max_priority,"
                " message_ttl, exclusive_owner, auto_delete, created_at)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    queue,
                    json_args(args),
                    max_priority,
                    None if ttl is None else int(ttl),
                    exclusive_owner,
                    int(auto_delete),
                    time.time(),
                ),
            )
            current = self.queue_arguments(queue)
        if current != args:
            raise precondition(
                f"inequivalent arguments for queue '{queue}' in vhost '/':"
                f" received {args} but current is {current}",
                QUEUE_DECLARE,
            )

    def delete_queue(self, queue: str, if_empty: bool = False) -> int:
        """Drop the queue, its bindings and messages; return ready count."""
        with self.lock, immediate(self.db):
            count = self._ready_count(queue)
            if if_empty and count:
                raise precondition(f"queue '{queue}' in vhost '/' is not empty", QUEUE_DELETE)
            self._drop_queue(queue)
        return count

    def _drop_queue(self, queue: str) -> None:
        for table, column in (
            ("broker_messages", "queue"),
            ("broker_bindings", "queue"),
            ("broker_consumers", "queue"),
            ("broker_queues", "name"),
        ):
            self.db.execute(f"DELETE FROM {table} WHERE {column} = ?", (queue,))

    def consumer_count(self, queue: str) -> int:
        with self.lock:
            row = self.db.execute(
                "SELECT COUNT(*) FROM broker_consumers WHERE queue = ?", (queue,)
            ).fetchone()
        return int(row[0])

    def add_consumer(self, queue: str, owner: str, tag: str) -> None:
        with self.lock:
            self.db.execute(
                "INSERT OR REPLACE INTO broker_consumers (owner, tag, queue) VALUES (?, ?, ?)",
                (owner, tag, queue),
            )

    def remove_consumers(self, owner: str, tag: str | None = None) -> None:
        """Forget consumers; an auto-delete queue left without any goes too."""
        where, params = (
            ("owner = ?", (owner,)) if tag is None else ("owner = ? AND tag = ?", (owner, tag))
        )
        with self.lock, immediate(self.db) as db:
            queues = {
                r[0]
                for r in db.execute(
                    f"DELETE FROM broker_consumers WHERE {where} RETURNING queue", params
                )
            }
            for queue in sorted(queues):
                if db.execute(
                    "SELECT 1 FROM broker_queues WHERE name = ? AND auto_delete = 1"
                    " AND NOT EXISTS (SELECT 1 FROM broker_consumers WHERE queue = ?)",
                    (queue, queue),
                ).fetchone():
                    self._drop_queue(queue)

    def _ready_count(self, queue: str) -> int:
        return int(
            self.db.execute(
                "SELECT COUNT(*) FROM broker_messages WHERE queue = ? AND claimed_by IS NULL",
                (queue,),
            ).fetchone()[0]
        )

    def size(self, queue: str) -> int:
        with self.lock:
            return self._ready_count(queue)

    def outstanding(self, queue: str) -> int:
        """Messages of ``queue`` not yet settled: ready ones and those a consumer holds."""
        with self.lock:
            return int(self.db.execute("SELECT COUNT(*) FROM broker_messages WHERE queue = ?",
                                       (queue,)).fetchone()[0])

    def purge(self, queue: str) -> int:
        """Delete ready messages; unacked ones stay, as in RabbitMQ."""
        with self.lock:
            return self.db.execute(
                "DELETE FROM broker_messages WHERE queue = ? AND claimed_by IS NULL",
                (queue,),
            ).rowcount
