"""A stored message: the kombu payload dict, and the headers the broker adds.

Rows hold the payload as kombu's JSON; what a consumer sees on top
(delivery tag, ``redelivered``, ``x-delivery-count``, ``x-death``) is made
here, from the row's columns, as RabbitMQ would have set it.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, cast

from kombu.utils import json as kombu_json

Payload = dict[str, Any]

# kombu's JSON (datetime, Decimal, UUID and bytes survive the round trip);
# payloads are never pickled.
dumps = cast(Callable[[Any], str], kombu_json.dumps)
loads = cast(Callable[[str], Any], kombu_json.loads)

DELIVERY_COUNT_HEADER = "x-delivery-count"


def expires_at(properties: dict[str, Any], now: float) -> float | None:
    """Absolute expiry from the AMQP ``expiration`` property (ms as text)."""
    expiration = properties.get("expiration")
    if expiration in (None, ""):
        return None
    try:
        return now + max(0, int(expiration)) / 1000.0
    except (TypeError, ValueError):
        return None


def priority(properties: dict[str, Any]) -> int:
    """The ``priority`` property; junk counts as 0, as RabbitMQ treats it."""
    try:
        return int(properties.get("priority") or 0)
    except (TypeError, ValueError):
        return 0


def split_tag(tag: Any) -> tuple[int, str] | None:
    """Delivery tags are ``row-id:claim``; anything else is not ours."""
    row, sep, claim = str(tag).partition(":")
    if not sep or not row.isdigit():
        return None
    return int(row), claim


def as_delivery(row: tuple[int, str, int, int], claim: str) -> Payload:
    """Build the payload kombu sees for a claimed row.

    The delivery tag carries the row id and the claim, so any channel can
    ack it and a stale tag cannot touch a later claim of the same row.
    """
    row_id, raw, count, redelivered = row
    payload: Payload = loads(raw)
    props = payload.setdefault("properties", {})
    props["delivery_tag"] = f"{row_id}:{claim}"
    info = props.get("delivery_info") or {}
    info["redelivered"] = bool(redelivered) or count > 1
    props["delivery_info"] = info
    headers = payload.get("headers") or {}
    headers[DELIVERY_COUNT_HEADER] = max(0, count - 1)
    payload["headers"] = headers
    return payload


def mark_death(payload: Payload, queue: str, reason: str) -> None:
    """Add RabbitMQ-style ``x-death`` headers to a dead-lettered payload."""
    props = payload.setdefault("properties", {})
    info = props.get("delivery_info") or {}
    headers = payload.get("headers") or {}
    entry: dict[str, Any] = {
        "queue": queue,
        "reason": reason,
        "count": 1,
        "exchange": info.get("exchange") or "",
        "routing-keys": [info.get("routing_key") or ""],
        "time": datetime.now(UTC),
    }
    expiration = props.pop("expiration", None)  # must not expire again
    if expiration is not None:
        entry["original-expiration"] = expiration
    headers["x-death"] = _deaths(headers, entry)
    for key, value in (("queue", queue), ("reason", reason), ("exchange", entry["exchange"])):
        headers.setdefault(f"x-first-death-{key}", value)
        headers[f"x-last-death-{key}"] = value
    payload["headers"] = headers


def _deaths(headers: dict[str, Any], entry: dict[str, Any]) -> list[dict[str, Any]]:
    """``x-death`` with `entry` first; a death of the same queue and reason is counted."""
    deaths = [dict(d) for d in headers.get("x-death") or []]
    for old in deaths:
        if old.get("queue") == entry["queue"] and old.get("reason") == entry["reason"]:
            entry["count"] = int(old.get("count", 0)) + 1
            deaths.remove(old)
            break
    return [entry, *deaths]
