"""Producing from code outside handlers: :class:`Producer` (scripts, web requests, the CLI).

The messages themselves are built by :func:`mdbcontainer.support.outgoing.outgoing`,
the same function ``ctx.send`` uses, so both carry the same defaults.
"""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

from ..errors import RequestTimeout, SettingsError
from ..message import Message
from ..settings import Settings, parse_duration
from ..support.outgoing import Outgoing, outgoing
from ..wire.connection import Broker
from ..wire.publisher import Publisher


class Producer:
    """Sends messages from code that is not a handler (scripts, web requests, the CLI).

    Each publish is confirmed by the broker and, to a queue, mandatory: a message
    the broker could not route raises :class:`~mdbcontainer.errors.Unroutable`.
    """

    def __init__(self, settings: Settings, broker: Broker | None = None) -> None:
        self.settings = settings
        self.broker = broker or Broker(settings)
        self._publisher = Publisher(self.broker)

    @classmethod
    def from_settings(cls, settings: Settings) -> Producer:
        return cls(settings)

    def send(
        self,
        destination: str,
        body: Any,
        *,
        priority: int | None = None,
        ttl: timedelta | str | float | None = None,
        persistent: bool = True,
        headers: dict[str, Any] | None = None,
        message_id: str | None = None,
        reply_to: str | None = None,
        correlation_id: str | None = None,
        content_type: str | None = None,
    ) -> str:
        """Send ``body`` to a queue or topic, confirmed by the broker; return the message id.

        Args:
            destination: a topic named in the settings (``[topics.NAME]``), else a queue.
                A queue must exist or be named in the settings: the publish is mandatory.
            body: ``str`` (sent as ``text/plain``), ``bytes`` (needs ``content_type``),
                or anything JSON-serialisable, a pydantic model included (``application/json``).
            priority: 0-9 (default 4, the JMS default).
            ttl: time to live (``"30s"``, a ``timedelta`` or seconds); expired, it is dropped
                or moved to the queue's ``expiry_queue``.
            persistent: written to disk by the broker (default); ``False`` may be lost on a
                broker restart.
            headers: application headers (``x-mdb-*`` are the container's own).
            message_id: the id a once-only consumer dedups on (default: a new uuid4).
            reply_to: the queue a reply should go to.
            correlation_id: ties a reply to its request.
            content_type: labels a ``str`` or ``bytes`` body (``application/xml``, ``image/png``).

        Raises:
            Unroutable: a queue that does not exist (nothing is sent or created).
            PublishError: the broker did not confirm the publish.
            BrokerUnavailable: no connection within ``connect_timeout``.
        """
        return self.publish(outgoing(
            destination, body, priority=priority, ttl=ttl, persistent=persistent, headers=headers,
            message_id=message_id, reply_to=reply_to, correlation_id=correlation_id,
            content_type=content_type,
        ))

    def publish(self, message: Outgoing) -> str:
        """Publish a message built by :func:`outgoing`; return its id."""
        exchange, routing_key, mandatory = self._publisher.route(message.destination)
        self._publisher.publish(
            exchange=exchange, routing_key=routing_key, body=message.body,
            properties=message.properties, mandatory=mandatory,
        )
        return message.message_id

    def request(
        self,
        destination: str,
        body: Any,
        *,
        timeout: timedelta | str | float = 10.0,
        priority: int | None = None,
        ttl: timedelta | str | float | None = None,
        persistent: bool = True,
        headers: dict[str, Any] | None = None,
        message_id: str | None = None,
        correlation_id: str | None = None,
        content_type: str | None = None,
    ) -> Message:
        """Send with ``reply_to`` set to a temporary queue and return the reply.

        The temporary queue lives as long as this request's connection (exclusive,
        auto-delete), as a JMS TemporaryQueue lives with its connection. The other
        keywords are those of :meth:`send`; ``correlation_id`` defaults to a new one.

        Raises:
            RequestTimeout: no reply within ``timeout``.
            SettingsError: the broker has no temporary reply queues (Amazon SQS).
            TransactionError: called from a handler inside a unit of work (the reply could
                only come after its commit).
        """
        from .replies import wait_for_reply

        if not self.broker.capabilities.replies:  # SQS: no temporary queue lives with a connection
            raise SettingsError(f"container.broker_url: request/reply needs temporary reply queues, "
                                f"which {self.broker.capabilities.name} has not")
        seconds = parse_duration(timeout).total_seconds()
        correlation = correlation_id or uuid.uuid4().hex

        def send(reply_to: str) -> str:
            return self.send(
                destination, body, priority=priority, ttl=ttl, persistent=persistent,
                headers=headers, message_id=message_id, reply_to=reply_to,
                correlation_id=correlation, content_type=content_type,
            )

        return wait_for_reply(self, destination, send, seconds, correlation)

    def close(self) -> None:
        self._publisher.close()

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["Outgoing", "Producer", "RequestTimeout", "outgoing"]
