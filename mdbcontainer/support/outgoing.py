"""Outgoing messages: what every publish of this package carries.

Every message this package produces carries a ``message_id`` (so a once-only
consumer can dedup it), priority 4 unless told otherwise (the JMS default),
and is persistent unless told otherwise. The wire's delivery-mode values
live here too, so that the broker seam and the pipeline read them from one
place.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from ..message import encode_body
from ..settings import parse_duration
from . import clock

DELIVERY_MODE_PERSISTENT = 2
DELIVERY_MODE_TRANSIENT = 1
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
    content_type: str | None = None,
) -> Outgoing:
    """Build an outgoing message with the package's defaults; validates priority and ttl.

    ``body``: text (``text/plain``), bytes (with ``content_type``), or data sent
    as JSON; ``content_type`` labels text or bytes otherwise.
    """
    if priority is not None and not (isinstance(priority, int) and 0 <= priority <= 9):
        raise ValueError(f"priority must be an integer from 0 to 9, not {priority!r}")
    data, ctype, encoding = encode_body(body, content_type)
    props: dict[str, Any] = {
        "message_id": message_id or uuid.uuid4().hex,
        "content_type": ctype,
        "content_encoding": encoding,
        "priority": DEFAULT_PRIORITY if priority is None else priority,
        "delivery_mode": DELIVERY_MODE_PERSISTENT if persistent else DELIVERY_MODE_TRANSIENT,
        "timestamp": int(clock.time()),
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
