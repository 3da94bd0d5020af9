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
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from .broker import Broker, Publisher
from .crash import crash_point
from .errors import PublishError
from .outgoing import Outgoing
from .store import Store, utcnow

log = logging.getLogger("mdbcontainer.outbox")

# Rows younger than this belong to a consumer that is publishing them now.
RELAY_GRACE = timedelta(seconds=5)
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


def _publish_row(publisher: Publisher, row: dict[str, Any], properties: dict[str, Any]) -> None:
    if row["declare_queue"]:
        publisher.route(row["declare_queue"])
    publisher.publish(
        exchange=row["exchange"], routing_key=row["routing_key"], body=row["body"],
        properties=properties, mandatory=row["mandatory"],
    )


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
        for index, item in enumerate(pending):
            _publish_row(publisher, item.values, item.properties)
            if index == 0:
                crash_point("outbox-dispatch")
        with self.store.engine.begin() as conn:
            conn.execute(delete(self.table).where(self.table.c.id.in_([p.id for p in pending])))

    def relay(self, publisher: Publisher, *, grace: timedelta = RELAY_GRACE) -> int:
        """Publish rows left by a crash; return how many were sent (0 while another container relays).

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
            for row in conn.execute(query).all():
                try:
                    _publish_row(publisher, row._asdict(), json.loads(row.properties))
                except PublishError as exc:
                    log.warning("outbox row %d (message %s) not published, retried later: %s",
                                row.id, json.loads(row.properties).get("message_id"), exc)
                    continue
                sent.append(row.id)
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
