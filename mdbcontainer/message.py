"""Message: the read-only envelope a handler receives, and body decoding.

Decoding is where untrusted bytes enter, so it accepts only the content types
of the port's ``accept`` list (JSON and text by default) and never anything
that runs code (pickle). A body that cannot be decoded or validated is poison
the container detects itself: :class:`InvalidBody` says why, in one line.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from pydantic import TypeAdapter, ValidationError

JSON = "application/json"
TEXT = "text/plain"
UTF8 = "utf-8"
BINARY = "binary"  # the content encoding of a body sent as bytes (kombu's name for it)
# A JSON document nested deeper than this is refused before it is parsed.
MAX_JSON_DEPTH = 64
_JSON = json.JSONDecoder()


class InvalidBody(Exception):
    """The body cannot become the handler's argument; backed out with reason ``invalid-body``."""


@dataclass(frozen=True, slots=True)
class Message:
    """One delivery as the handler sees it (read-only).

    ``redelivery_count`` counts failed earlier deliveries of this message (0 on
    the first); it survives process crashes because the container keeps it in
    its database, not in memory.
    """

    id: str
    body: Any
    headers: dict[str, Any] = field(default_factory=dict)
    redelivery_count: int = 0
    redelivered: bool = False
    priority: int = 0
    expires_at: datetime | None = None
    persistent: bool = True
    reply_to: str | None = None
    correlation_id: str | None = None
    timestamp: datetime | None = None
    destination: str = ""
    content_type: str = JSON
    raw: bytes = field(default=b"", repr=False)


def content_type_of(value: str | None) -> str:
    """The media type without parameters (``application/json; charset=utf-8`` → ``application/json``)."""
    return (value or "").split(";", 1)[0].strip().lower()


def accepted(accept: list[str]) -> frozenset[str]:
    """A port's ``accept`` list as the set of media types ``decode_body`` compares with."""
    return frozenset(content_type_of(a) for a in accept)


def decode_body(raw: bytes, content_type: str, accept: list[str] | frozenset[str], max_bytes: int,
                encoding: str | None = None) -> Any:
    """Turn the raw body into JSON data or text, refusing anything the port does not accept.

    A body sent as bytes (content encoding ``binary``) in an accepted type other
    than JSON or text stays bytes: an image or a PDF is not text.
    """
    if len(raw) > max_bytes:
        raise InvalidBody(f"body of {len(raw)} bytes is over max_message_bytes ({max_bytes})")
    types = accept if isinstance(accept, frozenset) else accepted(accept)
    # Most bodies carry a bare media type: it needs no parsing to be found in the set.
    ctype = content_type if content_type in types else content_type_of(content_type)
    if ctype not in types:
        raise InvalidBody(f"content type {ctype or '(none)'!r} is not accepted (accept: {sorted(types)})")
    if encoding == BINARY and ctype != TEXT and not ctype.endswith("json"):
        return raw
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidBody(f"body is not valid UTF-8: {exc.reason} at byte {exc.start}") from exc
    if ctype == TEXT or not ctype.endswith("json"):
        return text
    # A body of fewer characters than the depth, or with fewer brackets, cannot nest deeper.
    if len(raw) > MAX_JSON_DEPTH and text.count("[") + text.count("{") > MAX_JSON_DEPTH:
        _check_depth(text)
    try:
        return _JSON.decode(text)  # json.loads without its two calls around it
    except ValueError as exc:
        raise InvalidBody(f"body is not valid JSON: {exc}") from exc


def _check_depth(text: str) -> None:
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            escaped = not escaped and char == "\\"
            in_string = escaped or char != '"'
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
            if deepest > MAX_JSON_DEPTH:
                raise InvalidBody(f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
        elif char in "]}":
            depth -= 1


def validator_for(annotation: Any) -> TypeAdapter[Any] | None:
    """A pydantic adapter for the handler's first parameter, or None when it takes the Message."""
    if annotation is Message or annotation in (Any, None):
        return None
    return TypeAdapter(annotation)


def validate_body(adapter: TypeAdapter[Any], body: Any) -> Any:
    """Validate the decoded body into the handler's type; one line on failure."""
    try:
        return adapter.validate_python(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        raise InvalidBody(f"{where}: {first['msg']}{more}") from exc


def encode_body(body: Any, content_type: str | None = None) -> tuple[bytes, str, str]:
    """How producers of this package encode: (body bytes, content type, content encoding).

    Text is ``text/plain``, bytes are sent as they are (they need a
    ``content_type``: nothing can guess one), anything else is JSON. An explicit
    ``content_type`` labels text or bytes (``application/xml``, ``image/png``);
    data that is not text or bytes can only be labelled as a JSON type.
    """
    if isinstance(body, bytes | bytearray | memoryview):
        if not content_type:
            raise TypeError("a bytes body needs a content_type, e.g. content_type='application/octet-stream'")
        return bytes(body), content_type, BINARY
    if isinstance(body, str):
        return body.encode("utf-8"), content_type or TEXT, UTF8
    if content_type and not content_type_of(content_type).endswith("json"):
        raise TypeError(
            f"content_type {content_type!r} needs a str or bytes body; a {type(body).__name__} "
            "is sent as JSON (leave content_type out, or encode it yourself)"
        )
    if hasattr(body, "model_dump_json"):
        return body.model_dump_json().encode("utf-8"), content_type or JSON, UTF8
    return json.dumps(body, separators=(",", ":"), default=str).encode("utf-8"), content_type or JSON, UTF8


def body_hash_id(raw: bytes, routing_key: str) -> str:
    """An id derived from body and routing key, for ``missing_id = "body-hash"`` ports."""
    digest = hashlib.sha256(routing_key.encode() + b"\0" + raw).hexdigest()
    return f"sha256:{digest[:40]}"


def from_epoch(value: Any) -> datetime | None:
    """An AMQP timestamp (seconds) as an aware datetime, or None when absent or malformed."""
    if isinstance(value, datetime):
        return value if value.tzinfo else value.replace(tzinfo=UTC)
    if isinstance(value, int | float) and not isinstance(value, bool):
        try:
            return datetime.fromtimestamp(value, UTC)
        except (OverflowError, OSError, ValueError):
            return None
    return None
