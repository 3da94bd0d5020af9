"""Delivery: one message as the broker delivered it, and the only way to settle it.

The broker seam wraps every kombu message it receives in a :class:`Delivery`,
so no other module touches a kombu message: the pipeline reads a delivery's
properties here, and the acknowledgment modes (``acknowledge.py``) are the
only callers of :meth:`Delivery.ack`, :meth:`Delivery.reject` and
:meth:`Delivery.requeue`. Building the handler's :class:`Message` from a
delivery (:func:`envelope`) and a copy of it for another queue
(:meth:`Delivery.copy_to`) live here too, because both must see the wire's
properties exactly as they came.
"""

from __future__ import annotations

from dataclasses import fields
from datetime import UTC, datetime, timedelta
from typing import Any

from ..message import Message, decode_body, from_epoch
from ..support.outgoing import DELIVERY_MODE_PERSISTENT, Outgoing
from .headers import WAIT_EXPIRES_AT, WAIT_HEADERS, WAITED

# The AMQP properties a copy keeps (headers are handled apart; expiration is dropped).
_COPIED_PROPERTIES = (
    "content_type", "content_encoding", "delivery_mode", "priority", "correlation_id",
    "reply_to", "message_id", "timestamp", "type", "user_id", "app_id",
)


def body_bytes(body: Any, encoding: str | None) -> bytes:
    """A body as bytes (py-amqp decodes it to str when the producer set a content encoding)."""
    if isinstance(body, bytes):
        return body
    codec = "utf-8" if encoding in (None, "", "binary") else encoding
    return str(body).encode(codec, errors="surrogateescape")


class Delivery:
    """A received message: its properties, its body, and ack / reject / requeue.

    Cheap to build on the hot path: it keeps the transport's message and reads
    through to it.
    """

    __slots__ = ("_raw",)

    def __init__(self, raw: Any) -> None:
        self._raw = raw

    # -- what came ------------------------------------------------------------

    @property
    def properties(self) -> dict[str, Any]:
        return self._raw.properties  # type: ignore[no-any-return]

    def at_a_glance(self) -> tuple[dict[str, Any], dict[str, Any] | None, Any]:
        """(properties, headers or None, the broker's redelivered flag), uncopied, in one call:
        what the pipeline's first look at a delivery reads (its hot path)."""
        raw = self._raw
        return raw.properties, raw.headers, raw.delivery_info.get("redelivered")

    @property
    def headers(self) -> dict[str, Any]:
        return dict(self._raw.headers or {})

    def header(self, name: str) -> Any:
        """One header, or None (without copying them all: the hot path asks for one)."""
        headers = self._raw.headers
        return headers.get(name) if headers else None

    @property
    def body(self) -> bytes:
        return body_bytes(self._raw.body, self._raw.content_encoding)

    @property
    def content_type(self) -> str:
        return self._raw.content_type or ""

    @property
    def content_encoding(self) -> str | None:
        return self._raw.content_encoding or None

    @property
    def message_id(self) -> str | None:
        message_id = self._raw.properties.get("message_id")
        return str(message_id) if message_id else None

    @property
    def redelivered(self) -> bool:
        return bool(self._raw.delivery_info.get("redelivered"))

    @property
    def routing_key(self) -> str:
        return str(self._raw.delivery_info.get("routing_key", ""))

    @property
    def timestamp(self) -> Any:
        return self._raw.properties.get("timestamp")

    @property
    def acknowledged(self) -> bool:
        """True once acknowledged, rejected or requeued (kombu's ``acknowledged``)."""
        return bool(self._raw.acknowledged)

    def expires_at(self) -> datetime | None:
        """When a message with a TTL expires: its timestamp plus its ``expiration``."""
        expiration = self._raw.properties.get("expiration")
        if not expiration:  # the common case: no datetime work at all
            headers = self._raw.headers  # back from a wait: the expiry it kept
            waited = headers.get(WAIT_EXPIRES_AT) if headers else None
            return _parse_instant(waited) if waited else None
        stamp = from_epoch(self._raw.properties.get("timestamp"))
        if stamp is None:
            return None
        try:
            return stamp + timedelta(milliseconds=int(expiration))
        except (TypeError, ValueError, OverflowError):
            return None

    def copy_to(self, queue: str, headers: dict[str, Any], *, replace: bool = False) -> Outgoing:
        """This message, body, id and properties intact, bound for ``queue``.

        ``headers`` are added to the original's (or replace them). The
        expiration is dropped: a message kept for a person to inspect must not
        vanish from the backout queue.
        """
        props = {k: self.properties[k] for k in _COPIED_PROPERTIES if self.properties.get(k) is not None}
        props["headers"] = headers if replace else {**self.headers, **headers}
        props.setdefault("content_type", self.content_type or "application/octet-stream")
        return Outgoing(queue, self.body, props)

    # -- settling: only the acknowledgment modes call these -------------------

    def ack(self, *, multiple: bool = False) -> None:
        """Tell the broker the message is done (``multiple``: and every earlier one of the channel)."""
        self._raw.ack(multiple=multiple)

    def postpone(self, wait: timedelta) -> bool:
        """Leave the message on its queue, delivered again after ``wait``: True where the
        transport keeps a delay on the message itself (SQS's visibility timeout), settling it
        here; False where it cannot (then the delay is a wait queue, delays.py)."""
        postpone = getattr(self._raw.channel, "postpone", None)
        if postpone is None:
            return False
        postpone(self._raw.delivery_tag, wait.total_seconds())
        self._raw._state = "REQUEUED"  # settled: kombu's ``acknowledged`` says so
        return True

    def requeue(self) -> None:
        """Give the message back to its queue, to be delivered again."""
        self._raw.reject(requeue=True)

    def reject(self) -> None:
        """Drop the message (the broker dead-letters it where the queue says so)."""
        self._raw.reject(requeue=False)


_set = object.__setattr__  # Message is frozen: its own fields are set once, here
_FIELDS = tuple(f.name for f in fields(Message))


class _Envelope(Message):
    """A :class:`Message` whose rarely read fields come from the wire's properties when read.

    The body (decoded, so that an invalid one is backed out before the
    handler), the id, the headers and the counts are set as it is built; the
    priority, expiry, persistence, reply address, correlation id and
    timestamp are read from the AMQP properties only if the handler asks, so
    a delivery whose handler reads its body builds no datetime and checks no
    property. To its reader it is a Message like any other (a copy, or
    ``dataclasses.replace``, is a plain one).
    """

    __slots__ = ("_delivery",)
    _delivery: Delivery

    def __new__(cls, *args: Any, **changes: Any) -> Any:
        # dataclasses.replace() calls the class with every field: that is a plain Message.
        return Message(*args, **changes)

    def _plain(self) -> Message:
        return Message(*(getattr(self, name) for name in _FIELDS))

    def __reduce__(self) -> tuple[Any, ...]:
        return Message, tuple(getattr(self, name) for name in _FIELDS)

    def __repr__(self) -> str:
        return repr(self._plain())

    def __eq__(self, other: object) -> bool:
        return self._plain() == (other._plain() if isinstance(other, _Envelope) else other)

    @property
    def priority(self) -> int:
        value = self._delivery.properties.get("priority")
        return value if isinstance(value, int) and 0 <= value <= 255 else 0

    @property
    def expires_at(self) -> datetime | None:
        return self._delivery.expires_at()

    @property
    def persistent(self) -> bool:  # AMQP: absent is transient
        return bool(self._delivery.properties.get("delivery_mode") == DELIVERY_MODE_PERSISTENT)

    @property
    def reply_to(self) -> str | None:
        return self._delivery.properties.get("reply_to")

    @property
    def correlation_id(self) -> str | None:
        return self._delivery.properties.get("correlation_id")

    @property
    def timestamp(self) -> datetime | None:
        return from_epoch(self._delivery.properties.get("timestamp"))


def _parse_instant(text: Any) -> datetime | None:
    """An ISO 8601 instant from a header (UTC when it names no zone); None when it is not one."""
    try:
        instant = datetime.fromisoformat(str(text))
    except ValueError:
        return None
    return instant if instant.tzinfo else instant.replace(tzinfo=UTC)


def envelope(delivery: Delivery, message_id: str, count: int, accept: list[str] | frozenset[str],
             max_bytes: int, destination: str) -> Message:
    """The handler's Message for a delivery (decoding the body; may raise InvalidBody)."""
    raw = delivery._raw
    data = raw.body if type(raw.body) is bytes else body_bytes(raw.body, raw.content_encoding)
    content_type = raw.content_type or ""
    body = decode_body(data, content_type, accept, max_bytes, raw.content_encoding or None)
    message = object.__new__(_Envelope)
    _set(message, "_delivery", delivery)
    _set(message, "id", message_id)
    _set(message, "body", body)
    headers = dict(raw.headers or ())
    if WAITED in headers:  # back from a redelivery delay: the producer's headers only (README)
        headers = {k: v for k, v in headers.items() if k not in WAIT_HEADERS}
    _set(message, "headers", headers)
    _set(message, "redelivery_count", count)
    _set(message, "redelivered", count > 0 or bool(raw.delivery_info.get("redelivered")))
    _set(message, "destination", destination)
    _set(message, "content_type", content_type)
    _set(message, "raw", data)
    return message


class HeldMessages:
    """Messages taken from a queue without acknowledgment, for ``mdb dlq`` to browse or move.

    Each stays on its queue unless :meth:`remove` is called for it: closing the
    channel hands back every other one at its place.
    """

    def __init__(self, channel: Any, queue: str) -> None:
        self.channel = channel
        self.queue = queue

    def take_all(self, limit: int | None = None) -> list[Delivery]:
        """Every ready message of the queue (or the first ``limit``), held, in queue order."""
        from kombu.message import Message as KombuMessage

        taken: list[Delivery] = []
        while (limit is None or len(taken) < limit) and (
            raw := self.channel.basic_get(queue=self.queue, no_ack=False)
        ) is not None:
            message = raw if isinstance(raw, KombuMessage) else self.channel.message_to_python(raw)
            taken.append(Delivery(message))
        return taken

    def remove(self, delivery: Delivery) -> None:
        """The message leaves the queue (after its copy was confirmed elsewhere)."""
        delivery.ack()
