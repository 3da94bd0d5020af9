"""Reading a queue without consuming it, for tooling (``mdb dlq``).

A browse claims nothing and changes nothing: it shows what a consumer would
get next, in delivery order, and which messages a consumer holds now.
"""

from __future__ import annotations

import base64
import os

from .payload import Payload, as_delivery
from .queue_rows import QueueStore
from .schema import db_path


class BrowseStore(QueueStore):
    """The read-only view of a queue's rows."""

    def browse(self, queue: str) -> list[Payload]:
        with self.lock:
            rows = self.db.execute(
                "SELECT id, payload, delivery_count, redelivered, claimed_by"
                " FROM broker_messages WHERE queue = ?"
                " ORDER BY priority DESC, id",
                (queue,),
            ).fetchall()
        return [_browsed(row) for row in rows]


def _browsed(row: tuple[int, str, int, int, str | None]) -> Payload:
    """A stored row as tooling wants it: body decoded, claim state shown."""
    row_id, raw, count, redelivered, claimed_by = row
    payload = as_delivery((row_id, raw, count + 1, redelivered), "browse")
    props = payload["properties"]
    body = payload.get("body")
    if body is not None and props.get("body_encoding") == "base64":
        body = base64.b64decode(body)
    elif isinstance(body, str):
        body = body.encode("utf-8")
    props.pop("body_encoding", None)
    props.pop("delivery_tag", None)
    payload["body"] = body
    payload["claimed"] = claimed_by is not None
    return payload


def browse(path: str, queue: str) -> list[Payload]:
    """Messages of `queue` in delivery order, without consuming them.

    Each item is a kombu payload dict (``body`` as bytes, ``headers`` with
    ``x-delivery-count``, ``properties``) plus ``claimed``: True while a
    consumer holds it.  A missing file yields [] and is not created.
    """
    path = db_path(path)
    if not os.path.exists(path):
        return []
    store = BrowseStore(path)
    try:
        return store.browse(queue)
    finally:
        store.close()
