"""The kombu channel: deliveries as claims, settled in the file.

kombu's virtual transports requeue at the tail and lose what a killed
process held; this channel claims a row per delivery, and an ack, a requeue
or a close settles the claim in the file, so a requeued message keeps its
place at the head of the queue.  Declarations are in topology.py.
"""

from __future__ import annotations

import sqlite3
import time
import uuid
from collections import defaultdict
from queue import Empty
from typing import Any

from amqp.exceptions import ChannelError
from kombu.log import get_logger

from ..support import clock
from ..wire.transport import settled_tags
from .broker_state import BrokerState
from .claims import channel_closed, channel_opened, channel_token
from .errors import BASIC_RETURN, NoRoute
from .payload import Payload, split_tag
from .schema import DEFAULT_BUSY_TIMEOUT, db_path
from .topology import TopologyChannel

# The package's name, as before it was split: log lines keep their logger.
logger = get_logger("mdbcontainer.embedded")

DEFAULT_RECLAIM_INTERVAL = 3.0
#: How often a polling channel dead-letters the due messages of TTL queues nobody consumes.
EXPIRY_INTERVAL = 0.2


class Channel(TopologyChannel):
    """kombu channel whose state lives in the SQLite file, not in memory."""

    #: AMQP-style event handlers; ``basic_return`` gets unroutable mandatory
    #: publishes, as with py-amqp (kombu's Producer(on_return=...) uses it).
    events: defaultdict[str, set[Any]]

    def __init__(self, connection: Any, **kwargs: Any) -> None:
        super().__init__(connection, **kwargs)  # type: ignore[no-untyped-call]
        client = connection.client
        opts = client.transport_options
        self.events = defaultdict(set)
        self._no_ack_queues: set[str] = set()
        self._uid = uuid.uuid4().hex
        self._token = channel_token(self._uid)
        self._exclusive = set()
        self._reclaim_interval = float(opts.get("reclaim_interval", DEFAULT_RECLAIM_INTERVAL))
        self._store = BrokerState(
            db_path(client.hostname),
            busy_timeout=float(opts.get("busy_timeout", DEFAULT_BUSY_TIMEOUT)),
            synchronous=str(opts.get("synchronous", "NORMAL")),
        )
        self._next_reclaim = 0.0
        self._next_expiry = 0.0
        channel_opened(self._uid)
        self._maybe_reclaim()

    def _maybe_reclaim(self) -> None:
        """Release claims of dead processes, at most every few seconds."""
        now = time.monotonic()
        if now >= self._next_reclaim:
            self._next_reclaim = now + self._reclaim_interval
            self.store.release_dead_owners()

    # -- virtual channel storage API --------------------------------------

    def _new_queue(self, queue: str, **kwargs: Any) -> None:
        self.store.declare_queue(queue, kwargs.get("arguments"))

    def _has_queue(self, queue: str, **kwargs: Any) -> bool:
        return self.store.has_queue(queue)

    def _put(self, queue: str, message: Payload, **kwargs: Any) -> None:
        self.store.put(queue, message)

    def _get(self, queue: str, timeout: float | None = None) -> Payload:
        return self._fetch(queue, queue in self._no_ack_queues)

    def _maybe_expire(self) -> None:
        """Send back what waited long enough on a TTL queue, at most every EXPIRY_INTERVAL.

        By the container's clock, so a test that advances it sees the due messages come back
        at the next fetch.
        """
        now = clock.monotonic()
        if now >= self._next_expiry:
            self._next_expiry = now + EXPIRY_INTERVAL
            self.store.expire_due()

    def _fetch(self, queue: str, auto_ack: bool) -> Payload:
        self._maybe_reclaim()
        self._maybe_expire()
        payload = self.store.claim(queue, self._token, auto_ack)
        if payload is None:
            raise Empty()
        return payload

    def _size(self, queue: str) -> int:
        return self.store.size(queue)

    def expire_due(self) -> int:
        """Send back now what every TTL queue holds past its time (a test moved the clock)."""
        return self.store.expire_due()

    def outstanding(self, queue: str) -> int:
        """Ready and unacknowledged messages of ``queue`` (what a passive declare cannot say)."""
        return self.store.outstanding(queue)

    def _purge(self, queue: str) -> int:
        return self.store.purge(queue)

    def _delete(self, queue: str, *args: Any, **kwargs: Any) -> None:
        self.store.delete_queue(queue)

    # -- basic ------------------------------------------------------------

    def basic_publish(
        self, message: Payload, exchange: str, routing_key: str, **kwargs: Any
    ) -> None:
        """Route and store in one transaction; the publish is then durable.

        A mandatory publish nobody takes goes to ``basic_return`` handlers,
        or raises :class:`NoRoute` when there are none (py-amqp's way).
        """
        self._inplace_augment_message(  # type: ignore[no-untyped-call]
            message, exchange, routing_key
        )
        routed = self.store.publish(exchange or "", routing_key or "", message)
        if routed or not kwargs.get("mandatory"):
            return
        exc = NoRoute("NO_ROUTE", BASIC_RETURN, reply_code=312)
        handlers = self.events.get("basic_return")
        if not handlers:
            raise exc
        returned = self.Message(message, channel=self)  # type: ignore[no-untyped-call]
        for handler in list(handlers):
            handler(exc, exchange, routing_key, returned)

    def basic_consume(
        self, queue: str, no_ack: bool, callback: Any, consumer_tag: str, **kwargs: Any
    ) -> Any:
        """Consume; the consumer is recorded so auto-delete queues work."""
        if no_ack:
            self._no_ack_queues.add(queue)
        self.store.add_consumer(queue, self._token, consumer_tag)
        return super().basic_consume(  # type: ignore[no-untyped-call]
            queue, no_ack, callback, consumer_tag, **kwargs
        )

    def basic_cancel(self, consumer_tag: str) -> Any:
        queue = self._tag_to_queue.get(consumer_tag)
        result = super().basic_cancel(consumer_tag)  # type: ignore[no-untyped-call]
        if queue is not None:
            if queue not in self._tag_to_queue.values():
                self._no_ack_queues.discard(queue)
            self.store.remove_consumers(self._token, consumer_tag)
        return result

    def basic_get(self, queue: str, no_ack: bool = False, **kwargs: Any) -> Any:
        try:
            payload = self._fetch(queue, no_ack)
        except Empty:
            return None
        message = self.Message(payload, channel=self)  # type: ignore[no-untyped-call]
        if not no_ack:
            self.qos.append(message, message.delivery_tag)
        return message

    def _settle(self, delivery_tag: Any, multiple: bool) -> list[tuple[int, str]]:
        """Tags to settle, marked done in QoS (which frees prefetch slots)."""
        tags = settled_tags(self.qos, delivery_tag, multiple)
        for tag in tags:
            self.qos.ack(tag)
        return [t for t in map(split_tag, tags) if t is not None]

    def basic_ack(self, delivery_tag: Any, multiple: bool = False) -> None:
        self.store.ack(self._settle(delivery_tag, multiple))

    def basic_reject(self, delivery_tag: Any, requeue: bool = False) -> None:
        self.basic_nack(delivery_tag, multiple=False, requeue=requeue)

    def basic_nack(self, delivery_tag: Any, multiple: bool = False, requeue: bool = True) -> None:
        """Requeue at the head (a counted failure) or drop/dead-letter."""
        tags = self._settle(delivery_tag, multiple)
        if requeue:
            self.store.requeue(tags, counted=True)
        else:
            self.store.reject(tags)

    def _restore(self, message: Any) -> None:
        """Hand back an unacked message (close, recover): unclaim in place.

        Replaces kombu's re-publish at the tail.  If the database refuses
        (locked past the busy timeout), the claim stays with this channel's
        token, which dies with the channel: the next reclaim in this process
        releases it, so there is nothing for kombu's emergency dump to save.
        """
        self.hand_back(message.delivery_tag)

    def hand_back(self, delivery_tag: Any) -> None:
        """Unclaim without counting a failed delivery."""
        tag = split_tag(delivery_tag)
        if tag is None:
            return
        try:
            self.store.requeue([tag], counted=False)
        except (sqlite3.Error, ChannelError):
            logger.warning("embedded broker: could not hand back %s", delivery_tag, exc_info=True)

    def _restore_at_beginning(self, message: Any) -> None:
        tag = split_tag(message.delivery_tag)
        if tag is not None:
            self.store.requeue([tag], counted=True)

    def close(self) -> None:
        """Unclaim unacked messages (via QoS), drop exclusive queues, close."""
        try:
            super().close()  # type: ignore[no-untyped-call]
        finally:
            store, self._store = self._store, None
            if store is not None:
                self._close_store(store)

    def _close_store(self, store: BrokerState) -> None:
        try:
            for queue in self._exclusive:
                store.delete_queue(queue)
        except sqlite3.Error:
            logger.warning("embedded broker: could not delete exclusive queues", exc_info=True)
        finally:
            self._exclusive.clear()
            channel_closed(self._uid)
            store.close()
