"""Producing: building outgoing messages, and :class:`Producer` for code outside handlers.

Every message this package produces carries a ``message_id`` (so a once-only
consumer can dedup it), priority 4 unless told otherwise (the JMS default),
and is persistent unless told otherwise.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from .broker import DELIVERY_MODE_PERSISTENT, DELIVERY_MODE_TRANSIENT, Broker, Publisher
from .errors import RequestTimeout
from .message import Message, encode_body
from .settings import Settings, parse_duration

DEFAULT_PRIORITY = 4


@dataclass(frozen=True)
class Outgoing:
    """A message ready to publish: destination, encoded body and AMQP properties."""

    destination: str
    body: bytes
    properties: dict[str, Any] = field(default_factory=dict)
    # A reply goes to reply_to as it is: never declared, not mandatory (the requester owns it).
    reply: bool = False

    @property
    def message_id(self) -> str:
        return str(self.properties["message_id"])

    def to_json(self) -> str:
        """The properties as JSON text, for the outbox table (never pickle)."""
        return json.dumps(self.properties, default=str)


def outgoing(
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
) -> Outgoing:
    """Build an outgoing message with the package's defaults; validates priority and ttl."""
    if priority is not None and not (isinstance(priority, int) and 0 <= priority <= 9):
        raise ValueError(f"priority must be an integer from 0 to 9, not {priority!r}")
    data, content_type = encode_body(body)
    props: dict[str, Any] = {
        "message_id": message_id or uuid.uuid4().hex,
        "content_type": content_type,
        "priority": DEFAULT_PRIORITY if priority is None else priority,
        "delivery_mode": DELIVERY_MODE_PERSISTENT if persistent else DELIVERY_MODE_TRANSIENT,
        "timestamp": int(time.time()),
        "headers": dict(headers or {}),
    }
    if ttl is not None:
        seconds = parse_duration(ttl).total_seconds()
        if seconds <= 0:
            raise ValueError(f"ttl must be positive, not {ttl!r}")
        props["expiration"] = str(max(1, round(seconds * 1000)))
    if reply_to:
        props["reply_to"] = reply_to
    if correlation_id:
        props["correlation_id"] = correlation_id
    return Outgoing(destination, data, props)


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
