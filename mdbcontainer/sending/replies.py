"""Request/reply over a temporary queue (seed 001, 5.1.5).

``Producer.request`` opens a connection of its own and declares a temporary
queue on it: exclusive and auto-delete, server-named (``amq.gen-...``) on
RabbitMQ; on the embedded broker a uniquely named queue owned by the channel.
It sends the request with ``reply_to`` naming that queue and a correlation
id, waits for the reply carrying the same correlation id, and deletes the
queue, as a JMS TemporaryQueue lives only as long as its connection. A reply
that comes after the timeout finds no queue and is dropped by the broker.

A request from a handler inside a unit of work is refused. The seed's hang:
a send made inside a transaction leaves only when the transaction commits,
after the handler returns, so a handler waiting for the reply would wait
forever (and a request sent outside the transaction would break its
all-or-nothing promise). The consumer threads of ports with a unit of work
(``transaction = "container"`` or ``"bean"``, or ``acknowledge =
"transacted"``) are marked by :func:`mark_consumer_thread`; a thread-local
check catches ``Producer.request`` wherever the handler calls it from, even
deep inside a library, where a ``ctx.request`` method would catch only the
calls made through the context.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from contextlib import suppress
from typing import Any, Protocol

import kombu

from ..errors import MdbError, RequestTimeout, TransactionError
from ..message import JSON, TEXT, InvalidBody, Message
from ..settings import PortSettings
from ..wire.broker import Broker
from ..wire.delivery import Delivery, envelope


class Sender(Protocol):
    """What a request needs of its producer: the broker to open its reply queue on."""

    broker: Broker

MAX_REPLY_BYTES = 16 * 1024 * 1024

_thread = threading.local()


def mark_consumer_thread(port: str, settings: PortSettings) -> None:
    """Mark the calling consumer thread when its handlers run inside a unit of work."""
    if settings.acknowledge == "transacted":
        _thread.unit_of_work = (port, "acknowledge = 'transacted'")
    elif settings.transactional:
        _thread.unit_of_work = (port, f"transaction = {settings.transaction!r}")
    else:
        _thread.unit_of_work = None


def check_not_in_unit_of_work(destination: str) -> None:
    """Raise TransactionError when called from a handler inside a unit of work."""
    marked = getattr(_thread, "unit_of_work", None)
    if marked is None:
        return
    port, why = marked
    raise TransactionError(
        f"port {port!r}: request to {destination!r} refused inside a unit of work ({why}): a send "
        "inside it leaves only when it commits, after the handler returns, so the reply could "
        "never come in time and the handler would wait forever; send with ctx.send(..., "
        "reply_to=...) and handle the reply in a port of its own"
    )


def wait_for_reply(
    producer: Sender,
    destination: str,
    send: Callable[[str], object],
    seconds: float,
    correlation_id: str,
) -> Message:
    """Send the request with a temporary reply queue and return the reply (RequestTimeout otherwise).

    ``send(reply_to)`` publishes the request to ``destination`` with ``reply_to``
    set and ``correlation_id`` as its correlation id.
    """
    check_not_in_unit_of_work(destination)
    if seconds <= 0:
        raise ValueError(f"timeout must be positive, not {seconds:g}s")
    conn = producer.broker.connect()
    channel: Any = None
    consumer: kombu.Consumer | None = None
    queue = ""
    try:
        channel = conn.channel()
        queue = _temporary_queue(channel)
        replies: list[Delivery] = []
        consumer = _listen(channel, queue, correlation_id, replies)
        send(queue)
        raw = _wait(conn, replies, seconds)
        if raw is None:
            raise RequestTimeout(
                f"no reply from {destination!r} within {seconds:g}s (correlation id "
                f"{correlation_id}); a later reply is dropped with the temporary queue"
            )
        return _message(raw, queue)
    finally:
        _close(conn, channel, consumer, queue)


def _temporary_queue(channel: Any) -> str:
    """Exclusive, auto-delete, not durable; the broker names it (the embedded transport too)."""
    ok = channel.queue_declare(queue="", durable=False, exclusive=True, auto_delete=True)
    return str(ok.queue)


def _listen(channel: Any, queue: str, correlation_id: str, replies: list[Delivery]) -> kombu.Consumer:
    def keep(raw: Any) -> None:
        # Replies to an earlier request of this queue cannot exist (the queue is new);
        # a stray message without our correlation id is dropped.
        delivery = Delivery(raw)
        if delivery.properties.get("correlation_id") == correlation_id:
            replies.append(delivery)

    consumer = kombu.Consumer(channel, queues=[kombu.Queue(queue, no_declare=True)],
                              on_message=keep, no_ack=True, auto_declare=False, accept=None)
    consumer.consume()
    return consumer


def _wait(conn: kombu.Connection, replies: list[Delivery], seconds: float) -> Delivery | None:
    deadline = time.monotonic() + seconds
    while not replies:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        with suppress(socket.timeout, TimeoutError):
            conn.drain_events(timeout=min(remaining, 1.0))
    return replies[0]


def _message(reply: Delivery, queue: str) -> Message:
    message_id = reply.message_id
    try:
        return envelope(reply, message_id or "", 0, [JSON, TEXT], MAX_REPLY_BYTES, queue)
    except InvalidBody as exc:
        raise MdbError(f"reply {message_id} cannot be read: {exc}") from exc


def _close(conn: kombu.Connection, channel: Any, consumer: kombu.Consumer | None, queue: str) -> None:
    """Cancel, delete the temporary queue (the broker would with the connection) and close.

    Cancel first: deleting a queue under its own consumer makes the broker
    cancel it, and py-amqp then fails to close the connection's socket.
    """
    if consumer is not None:
        with suppress(Exception):
            consumer.cancel()
    if channel is not None and queue:
        with suppress(Exception):
            channel.queue_delete(queue=queue)
    with suppress(Exception):
        conn.close()
