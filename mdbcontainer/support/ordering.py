"""The key of an ordered port (README "Ordered ports"): read from a header or a top-level JSON field.

``order_by = "JMSXGroupID"`` (any header name) or ``order_by = "body:account_id"``.
The pipeline reads it from a delivery to keep one message per key in flight; a
producer reads it from the message it publishes, to route it to the key's
partition. Both read it the same way, here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

BODY = "body:"


@dataclass(frozen=True)
class OrderKey:
    """How to read the key of a message: a header's value, or a JSON body's top-level field."""

    order_by: str

    @property
    def field(self) -> str | None:
        """The body field named by ``body:FIELD``; None for a header."""
        return self.order_by[len(BODY):] if self.order_by.startswith(BODY) else None

    def of(self, headers: dict[str, Any] | None, body: bytes | str | None) -> str | None:
        """The key of a message, or None when it has none (it is then handled as a key of its own).

        A body that is not a JSON object has no body field: no key, never an error
        here (the pipeline backs an undecodable body out with ``invalid-body`` anyway).
        """
        name = self.field
        value = (headers or {}).get(self.order_by) if name is None else _field(body, name)
        if value is None:
            return None
        if isinstance(value, bytes):
            return value.decode("utf-8", "replace")
        return value if isinstance(value, str) else json.dumps(value, sort_keys=True)


def _field(body: bytes | str | None, name: str) -> Any:
    if not body:
        return None
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    return data.get(name) if isinstance(data, dict) else None
