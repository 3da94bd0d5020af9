"""Request/reply over a temporary queue (README: JMS reliability mechanisms).

``Producer.request`` opens a connection of its own and declares a temporary
queue on it: exclusive and auto-delete, server-named (``amq.gen-...``) on
RabbitMQ; on the embedded broker a uniquely named queue owned by the channel.
It sends the request with ``reply_to`` naming that queue and a correlation
id, waits for the reply carrying the same correlation id, and deletes the
queue, as a JMS TemporaryQueue lives only as long as its connection. A reply
that comes after the timeout finds no queue and is dropped by the broker.

A request from a handler inside a unit of work is refused. The classic hang:
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

import threading
from collections.abc import Callable
from typing import Protocol

from ..errors import MdbError, RequestTimeout, TransactionError
from ..message import JSON, TEXT, InvalidBody, Message
from ..settings import PortSettings
from ..wire.connection import Broker
from ..wire.delivery import Delivery, envelope
from ..wire.queues import ReplyQueue


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
    with ReplyQueue(producer.broker, correlation_id) as replies:
        send(replies.name)
        raw = replies.wait(seconds)
        if raw is None:
            raise RequestTimeout(
                f"no reply from {destination!r} within {seconds:g}s (correlation id "
                f"{correlation_id}); a later reply is dropped with the temporary queue"
            )
        return _message(raw, replies.name)


def _message(reply: Delivery, queue: str) -> Message:
    message_id = reply.message_id
    try:
        return envelope(reply, message_id or "", 0, [JSON, TEXT], MAX_REPLY_BYTES, queue)
    except InvalidBody as exc:
        raise MdbError(f"reply {message_id} cannot be read: {exc}") from exc

