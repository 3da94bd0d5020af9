"""Queues as tools see them: depth, purge, delete-if-unused, browse, and a temporary reply queue.

The modules above the wire (``operations``, ``sending.replies``, ``cli.watch``,
``testing``) do these through the seam and never hold a kombu channel, a
kombu consumer or an amqp error class: a broker's quirk (RabbitMQ closes a
channel on NOT_FOUND; the embedded broker is browsed by reading its file) is
handled once, here.

A queue that does not exist is the broker's own NOT_FOUND error where a
method says it raises (a misspelt name must not pass for an empty queue), and
``None`` where it says so.
"""

from __future__ import annotations

import socket
import time
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

import kombu
from amqp.exceptions import NotFound

from .connection import Broker, connection_errors
from .delivery import Delivery, HeldMessages, body_bytes

# Properties of a delivery that say how it was delivered, not what was sent.
_DELIVERY_ONLY = ("application_headers", "delivery_info", "delivery_tag", "body_encoding")


@dataclass(frozen=True)
class QueueStatus:
    """What a passive declare tells about a queue."""

    messages: int
    consumers: int


@dataclass(frozen=True)
class Browsed:
    """One message of a browsed queue, as it was sent; it stays on its queue."""

    properties: dict[str, Any]
    headers: dict[str, Any]
    body: bytes
    content_type: str


class QueueSession:
    """One connection and one channel for operations on queues.

    Closing it hands back every message taken without acknowledgment, at its
    place. After a failed operation (RabbitMQ closes the channel on NOT_FOUND)
    the next one takes a fresh channel on the same connection.
    """

    def __init__(self, broker: Broker, *, timeout: float | None = None) -> None:
        self.broker = broker
        self._conn = broker.connect(timeout=timeout)
        self._channel: Any = None

    @property
    def _chan(self) -> Any:
        if self._channel is None:
            self._channel = self._conn.channel()
        return self._channel

    def _drop_channel(self) -> None:
        channel, self._channel = self._channel, None
        if channel is not None:
            with suppress(Exception):
                channel.close()

    def status(self, queue: str) -> QueueStatus:
        """Ready messages and consumers of ``queue``; raises the broker's NOT_FOUND when it is missing."""
        try:
            ok = self._chan.queue_declare(queue=queue, passive=True)
        except connection_errors():
            raise
        except Exception:
            self._drop_channel()
            raise
        return QueueStatus(int(ok.message_count or 0), int(ok.consumer_count or 0))

    def find(self, queue: str) -> QueueStatus | None:
        """Like :meth:`status`, but None when ``queue`` does not exist."""
        try:
            return self.status(queue)
        except NotFound:
            return None

    def outstanding(self, queue: str) -> int | None:
        """Ready plus unacknowledged messages of ``queue`` where the broker can tell, else None."""
        if not self.broker.capabilities.counts_unacknowledged:
            return None
        return int(self._chan.outstanding(queue))

    def expire_due(self) -> bool:
        """Dead-letter now what TTL queues hold past its time, where this process keeps the broker's
        clock (the embedded broker); False where the broker keeps its own (RabbitMQ)."""
        if not self.broker.capabilities.local_file:
            return False
        self._chan.expire_due()
        return True

    def subscribe(self, topic: str, name: str) -> str:
        """A non-durable subscription queue ``name`` on ``topic`` that lives as long as this session."""
        return str(self.broker.declare_subscription(self._chan, topic, name, False))

    def exists(self, queue: str) -> bool:
        return self.find(queue) is not None

    def declare(self, queue: str) -> None:
        """Declare durable queue ``queue`` with its settings' arguments, as the container does."""
        self.broker.declare_queue(self._chan, queue)

    def purge(self, queue: str) -> int:
        """Drop every ready message of existing ``queue``; return how many went."""
        self.status(queue)
        return int(self._chan.queue_purge(queue=queue) or 0)

    def delete_if_unused(self, queue: str) -> int:
        """Delete ``queue`` unless it has consumers; return how many messages went with it.

        The broker checks again as it deletes: a consumer that came since
        :meth:`status` keeps the queue.
        """
        return int(self._chan.queue_delete(queue=queue, if_unused=True) or 0)

    def hold(self, queue: str) -> HeldMessages:
        """Messages of ``queue`` to take without acknowledgment (handed back when this closes)."""
        return HeldMessages(self._chan, queue)

    def take(self, queue: str, limit: int = 100_000) -> list[Delivery]:
        """Consume and acknowledge up to ``limit`` ready messages of existing ``queue``."""
        self.status(queue)
        out: list[Delivery] = []
        while len(out) < limit:
            raw = self._chan.basic_get(queue=queue, no_ack=True)
            if raw is None:
                break
            out.append(Delivery(raw if isinstance(raw, kombu.Message) else self._chan.message_to_python(raw)))
        return out

    def browse(self, queue: str, limit: int | None = None) -> tuple[list[Browsed], int]:
        """The first ``limit`` messages of ``queue`` (all with None), in order, and how many it holds.

        Nothing leaves the queue: the embedded broker's file is read without
        claiming anything; on RabbitMQ the messages are held and handed back
        when this session closes (so browse each queue in a session of its own).
        """
        if self.broker.capabilities.local_file:
            from .. import embedded

            path = self.broker.connection().hostname  # the same file the connection opens
            every = embedded.browse(path, queue)
            return [_from_payload(p) for p in every[:limit]], len(every)
        # Taking only the first ``limit`` keeps a deep queue's browse short; the rest are counted.
        taken = self.hold(queue).take_all(limit)
        rest = self.status(queue).messages
        return [_from_delivery(m) for m in taken], len(taken) + rest

    def close(self) -> None:
        self._channel = None
        with suppress(Exception):
            self._conn.close()

    def __enter__(self) -> QueueSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _from_delivery(message: Delivery) -> Browsed:
    props = {k: v for k, v in message.properties.items() if k not in _DELIVERY_ONLY}
    return Browsed(props, message.headers, message.body, message.content_type)


def _from_payload(payload: dict[str, Any]) -> Browsed:
    """A message as :func:`mdbcontainer.embedded.browse` returns it."""
    props = {k: v for k, v in (payload.get("properties") or {}).items() if k not in _DELIVERY_ONLY}
    return Browsed(
        props,
        dict(payload.get("headers") or {}),
        body_bytes(payload.get("body") or b"", payload.get("content-encoding")),
        str(payload.get("content-type") or ""),
    )


class ReplyQueue:
    """A temporary reply queue and its consumer, for one request.

    Exclusive, auto-delete, not durable and named by the broker (``amq.gen-...``
    on RabbitMQ; the embedded transport names it too), on a connection of its
    own. Only deliveries carrying ``correlation_id`` are kept; a stray message
    is dropped.
    """

    def __init__(self, broker: Broker, correlation_id: str) -> None:
        self.correlation_id = correlation_id
        self.name = ""
        self._replies: list[Delivery] = []
        self._channel: Any = None
        self._consumer: kombu.Consumer | None = None
        self._conn = broker.connect()
        try:
            self._channel = self._conn.channel()
            ok = self._channel.queue_declare(queue="", durable=False, exclusive=True, auto_delete=True)
            self.name = str(ok.queue)
            self._consumer = kombu.Consumer(
                self._channel, queues=[kombu.Queue(self.name, no_declare=True)], on_message=self._keep,
                no_ack=True, auto_declare=False, accept=None)
            self._consumer.consume()
        except BaseException:
            self.close()
            raise

    def _keep(self, raw: Any) -> None:
        # Replies to an earlier request of this queue cannot exist (the queue is new).
        delivery = Delivery(raw)
        if delivery.properties.get("correlation_id") == self.correlation_id:
            self._replies.append(delivery)

    def wait(self, seconds: float) -> Delivery | None:
        """The first reply within ``seconds``, or None."""
        deadline = time.monotonic() + seconds
        while not self._replies:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            with suppress(socket.timeout, TimeoutError):
                self._conn.drain_events(timeout=min(remaining, 1.0))
        return self._replies[0]

    def close(self) -> None:
        """Cancel, delete the queue (the broker would with the connection) and close.

        Cancel first: deleting a queue under its own consumer makes the broker
        cancel it, and py-amqp then fails to close the connection's socket.
        """
        if self._consumer is not None:
            with suppress(Exception):
                self._consumer.cancel()
        if self._channel is not None and self.name:
            with suppress(Exception):
                self._channel.queue_delete(queue=self.name)
        with suppress(Exception):
            self._conn.close()

    def __enter__(self) -> ReplyQueue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

