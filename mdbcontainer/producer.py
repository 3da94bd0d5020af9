"""Producing from code outside handlers: :class:`Producer` (scripts, web requests, the CLI).

The messages themselves are built by :func:`mdbcontainer.outgoing.outgoing`,
the same function ``ctx.send`` uses, so both carry the same defaults.
"""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

from .broker import Broker, Publisher
from .errors import RequestTimeout
from .message import Message
from .outgoing import Outgoing, outgoing
from .settings import Settings, parse_duration


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

    def send(self, destination: str, body: Any, **options: Any) -> str:
        """Send ``body`` to a queue or topic; return the message id."""
        return self.publish(outgoing(destination, body, **options))

    def publish(self, message: Outgoing) -> str:
        exchange, routing_key, mandatory = self._publisher.route(message.destination)
        self._publisher.publish(
            exchange=exchange, routing_key=routing_key, body=message.body,
            properties=message.properties, mandatory=mandatory,
        )
        return message.message_id

    def request(
        self, destination: str, body: Any, *, timeout: timedelta | str | float = 10.0, **options: Any
    ) -> Message:
        """Send with ``reply_to`` set to a temporary queue and return the reply.

        The temporary queue lives as long as this request's connection (exclusive,
        auto-delete), as a JMS TemporaryQueue lives with its connection.
        """
        from .replies import wait_for_reply

        seconds = parse_duration(timeout).total_seconds()
        correlation_id = options.pop("correlation_id", None) or uuid.uuid4().hex
        return wait_for_reply(self, destination, body, seconds, correlation_id, options)

    def close(self) -> None:
        self._publisher.close()

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["Outgoing", "Producer", "RequestTimeout", "outgoing"]
