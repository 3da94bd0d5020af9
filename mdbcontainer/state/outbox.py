"""The outbox: sends made inside a unit of work leave only after it commits.

``ctx.send`` inside a container- or bean-managed transaction writes a row in
the same transaction. After the commit the delivering consumer publishes the
rows with broker confirms and deletes them; a crash in between leaves rows
that the relay publishes later. A send is therefore published at least once,
with its message id kept, so a once-only consumer downstream applies it once.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from sqlalchemy import delete, select

from ..errors import PublishError
from ..support.crash import crash_point
from ..support.outgoing import Outgoing
from ..wire.connection import Broker
from ..wire.publisher import Publish, Publisher
from .store import Store, utcnow

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

log = logging.getLogger("mdbcontainer.outbox")

RELAY_BATCH = 200
# One container of a fleet relays at a time (PostgreSQL advisory lock key, held by
# the relay's transaction): two relays would publish the same rows twice.
RELAY_LOCK = 7426003


@dataclass(frozen=True)
class Pending:
    """An outbox row written in the current transaction, kept to publish after the commit."""

    id: int
    values: dict[str, Any]
    properties: dict[str, Any]


def _publish_rows(publisher: Publisher, rows: list[tuple[dict[str, Any], dict[str, Any]]], *,
                  after_first: Callable[[], None] | None = None) -> list[PublishError | None]:
    """Publish rows with their confirms awaited together; per row, None or why it was not taken.

    A destination the broker refuses to declare fails its rows only.
    """
    errors: list[PublishError | None] = [None] * len(rows)
    items: list[Publish] = []
    indexes: list[int] = []
    for index, (row, properties) in enumerate(rows):
        if row["declare_queue"]:
            try:
                publisher.route(row["declare_queue"])
            except PublishError as exc:
                errors[index] = exc
                continue
        items.append(Publish(row["exchange"], row["routing_key"], row["body"], properties,
                             row["mandatory"]))
        indexes.append(index)
    for index, error in zip(indexes, publisher.publish_many(items, after_first=after_first),
                            strict=True):
        errors[index] = error
    return errors


class Outbox:
    """Writes, dispatches and relays outbox rows."""

    def __init__(self, store: Store, broker: Broker) -> None:
        self.store = store
        self.broker = broker
        self.table = store.tables.outbox

    def write(self, session: Session, port: str, messages: list[Outgoing]) -> list[Pending]:
        """Insert rows for ``messages`` in the caller's transaction (one round trip each)."""
        pending = []
        for message in messages:
            message = self.broker.tracing.carry(message)  # the relay publishes it in this trace
            exchange, routing_key, mandatory = self.broker.route(message.destination)
            mandatory = mandatory and not message.reply  # a reply is never declared
            values = {
                "created_at": utcnow(), "port": port, "exchange": exchange,
                "routing_key": routing_key, "mandatory": mandatory, "body": message.body,
                # Declared before the publish, a topic's exchange too (a publish to an
                # exchange nobody declared is refused); a reply never is.
                "declare_queue": None if message.reply else message.destination,
                "properties": message.to_json(),
            }
            row_id = session.execute(
                self.table.insert().values(values).returning(self.table.c.id)
            ).scalar_one()
            pending.append(Pending(int(row_id), values, message.properties))
        return pending

    def dispatch(self, publisher: Publisher, pending: list[Pending]) -> None:
        """Publish committed rows, then delete them (crash point ``outbox-dispatch`` lies between)."""
        if not pending:
            return
        errors = _publish_rows(publisher, [(p.values, p.properties) for p in pending],
                               after_first=lambda: crash_point("outbox-dispatch"))
        sent = [p.id for p, error in zip(pending, errors, strict=True) if error is None]
        if sent:
            with self.store.engine.begin() as conn:
                conn.execute(delete(self.table).where(self.table.c.id.in_(sent)))
        failed = next((error for error in errors if error is not None), None)
        if failed is not None:  # the rows stay: the relay publishes them later
            raise failed

    def relay(self, publisher: Publisher, *, grace: timedelta) -> int:
        """Publish rows left by a crash; return how many were sent (0 while another container relays).

        Only rows older than ``grace`` (``outbox_relay_grace``): a younger one may
        be one its consumer is publishing now.

        A row the broker will not take (unroutable, not confirmed) is skipped and
        retried next time, so one bad row never blocks the rows behind it. On
        PostgreSQL one relay runs at a time across the fleet (an advisory lock
        for the transaction); the rows are also locked and locked rows skipped,
        so a consumer deleting the rows it has just published waits, then
        finds them gone.
        """
        cutoff = utcnow() - grace
        query = (
            select(self.table)
            .where(self.table.c.created_at < cutoff)
            .order_by(self.table.c.id)
            .limit(RELAY_BATCH)
        )
        if self.store.dialect == "postgresql":
            query = query.with_for_update(skip_locked=True)
        sent: list[int] = []
        with self.store.engine.begin() as conn:
            if not self._relay_lock(conn):
                log.debug("another container is relaying the outbox")
                return 0
            rows = conn.execute(query).all()
            parsed = [(row._asdict(), json.loads(row.properties)) for row in rows]
            for (values, properties), error in zip(parsed, _publish_rows(publisher, parsed), strict=True):
                if error is not None:
                    log.warning("outbox row %d (message %s) not published, retried later: %s",
                                values["id"], properties.get("message_id"), error)
                    continue
                sent.append(values["id"])
            if sent:
                conn.execute(delete(self.table).where(self.table.c.id.in_(sent)))
        if sent:
            log.info("outbox relay published %d message(s) left by an earlier process", len(sent))
        return len(sent)

    def _relay_lock(self, conn: Any) -> bool:
        if self.store.dialect != "postgresql":
            return True
        return bool(conn.exec_driver_sql(f"SELECT pg_try_advisory_xact_lock({RELAY_LOCK})").scalar())

    def backlog(self) -> int:
        from sqlalchemy import func

        with self.store.engine.connect() as conn:
            return int(conn.execute(select(func.count()).select_from(self.table)).scalar() or 0)
