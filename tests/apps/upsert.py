"""Ports ``Upsert``, ``UpsertBean`` and ``UpsertBatch``: "insert if missing", the error swallowed.

Each message inserts its ``effects`` row, then the body's ``key`` into
``unique_keys``, and catches the ``IntegrityError`` when the key is there
already, the common idiom written without a savepoint. On PostgreSQL that
error aborts the whole transaction (the ``effects`` rows and the dedup marks
with it) and its COMMIT then rolls back without raising; on SQLite only the
statement fails. ``Upsert`` takes its transaction from the settings
(container-managed, per message or on a batched port); ``UpsertBean``
(upsertbean.py) is bean-managed; ``UpsertBatch`` (upsertbatch.py) is a batch
handler, container- or bean-managed.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.exc import IntegrityError

from mdbcontainer import Message, MessageContext, message_driven

from .common import effects, log_attempt, unique_keys


def upsert(port: str, message: Message, session: Any) -> None:
    body: dict[str, Any] = message.body if isinstance(message.body, dict) else {}
    log_attempt(port, message)
    session.execute(effects.insert().values(port=port, message_id=message.id, n=body.get("n")))
    try:
        session.execute(unique_keys.insert().values(key=body["key"]))
    except IntegrityError:
        pass  # "already there": the mistake this module exists for


@message_driven("Upsert")
def on_upsert(message: Message, ctx: MessageContext) -> None:
    upsert("Upsert", message, ctx.session)
