"""The outbox: sends that leave only after the transaction they were made in commits.

``ctx.send`` inside a container- or bean-managed transaction writes a row in
the same transaction. After the commit the delivering consumer publishes the
rows with broker confirms and deletes them; a crash in between leaves rows
that the relay publishes later. A send is therefore published at least once,
with its message id kept, so a once-only consumer downstream applies it once.

Code outside handlers (a web request, a job) sends the same way through
:meth:`Outbox.send` and the caller's own ``Session`` or ``AsyncSession``
(CONTRACT section 15). Nobody dispatches those rows after the commit: their
``port`` is :data:`ANY_CODE` and the relay publishes them at once, told on
PostgreSQL by a notification the insert queues for the commit.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from functools import cached_property
from typing import TYPE_CHECKING, Any

from sqlalchemy import and_, bindparam, delete, func, or_, select

from ..errors import PublishError
from ..support.crash import crash_point
from ..support.outgoing import Outgoing, outgoing
from ..wire.connection import Broker
from ..wire.publisher import Publish, Publisher
from .sessions import DatabaseCheck, deferred_rows, sync_session_of
from .store import Store, utcnow

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from ..settings import Settings

log = logging.getLogger("mdbcontainer.outbox")

RELAY_BATCH = 200
# One relay of a fleet at a time: two would publish the same rows twice. On PostgreSQL
# a session advisory lock in this class, keyed by the outbox table's qualified name
# (as the dedup purge's), so services keeping their tables in other schemas of one
# database each have a relay; on SQLite the round's own write lock (BEGIN IMMEDIATE).
RELAY_LOCK_CLASS = 7426003
# The ``port`` of a row that code outside any handler wrote: no consumer publishes it
# after the commit, so the relay does at once (a handler's rows only past the grace).
ANY_CODE = ""
WARN_AGAIN = 60.0  # seconds before the relay warns again about the same refused row
_ROW_COLUMNS = ("created_at", "port", "exchange", "routing_key", "mandatory", "body", "declare_queue",
                "properties")


@dataclass(frozen=True)
class Waiting:
    """The sends in the outbox: how many, and the age of the oldest (seconds, 0 when none)."""

    count: int
    oldest_seconds: float


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
    """The container's outbox table: sends that leave only once their transaction commits.

    Code outside handlers makes one with :meth:`from_settings` and calls
    :meth:`send` with its own session; the container writes a handler's sends
    (:meth:`write`) and publishes them after the commit (:meth:`dispatch`); the
    relay publishes whatever is left (:meth:`relay`).
    """

    def __init__(self, store: Store, broker: Broker) -> None:
        self.store = store
        self.broker = broker
        self.table = store.tables.outbox
        self._check = DatabaseCheck(store.url)
        self._warned: dict[int, float] = {}  # row id: when the relay last warned that it waits

    @classmethod
    def from_settings(cls, settings: Settings) -> Outbox:
        """The outbox of the settings' container database; connects to nothing until used.

        Code outside handlers calls :meth:`send` on it; ``mdb run`` and ``mdb relay``
        publish what it wrote.
        """
        return cls(Store(settings.container), Broker(settings))

    def send(
        self,
        session: Any,
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
    ) -> str:
        """Send ``body`` when ``session``'s transaction commits, never if it rolls back; return the id.

        The keywords are :meth:`Producer.send`'s. A row goes into the outbox table
        through the caller's ``Session`` (at once) or ``AsyncSession`` (at its
        commit, the one moment its connection can be written without an ``await``);
        the relay of a running ``mdb run`` or ``mdb relay`` publishes it, confirmed,
        in the order of this transaction's sends, with the trace context current now.

        Raises:
            TransactionError: ``session`` is bound to another database than
                ``database_url`` (nothing is written).
            ValueError: a bad priority or ttl.
        """
        sync = sync_session_of(session)
        self._check(sync)
        message = outgoing(
            destination, body, priority=priority, ttl=ttl, persistent=persistent, headers=headers,
            message_id=message_id, reply_to=reply_to, correlation_id=correlation_id,
            content_type=content_type,
        )
        values, _ = self._row(ANY_CODE, message)
        if sync is session:
            self._insert_any(sync, [values])
        else:
            deferred_rows(sync, self._insert_any).append(values)
        return message.message_id

    def _insert_any(self, session: Session, rows: list[dict[str, Any]]) -> None:
        """Rows of code outside handlers; on PostgreSQL the relay is told at commit (same statement)."""
        for values in rows:
            session.execute(self._any_insert, values)

    @cached_property
    def _any_insert(self) -> Any:
        """The insert of :meth:`send`, built once (a statement per send cost more than its row)."""
        t = self.table
        insert = t.insert().values({name: bindparam(name) for name in _ROW_COLUMNS})
        if self.store.dialect != "postgresql":
            return insert
        sent = insert.returning(t.c.id).cte("sent")
        return select(sent.c.id, func.pg_notify(self.channel, ""))

    @cached_property
    def channel(self) -> str:
        """The PostgreSQL notification channel of this outbox table (an identifier of <= 63 bytes)."""
        name = self.qualified_name
        if len(name) <= 63 and name.replace("_", "").replace(".", "").isalnum():
            return name
        return "mdb_outbox_" + hashlib.sha1(name.encode()).hexdigest()[:20]

    @property
    def qualified_name(self) -> str:
        t = self.table
        return f"{t.schema}.{t.name}" if t.schema else t.name

    def _row(self, port: str, message: Outgoing) -> tuple[dict[str, Any], dict[str, Any]]:
        """A row's values, and the properties it publishes with (the trace context in them)."""
        message = self.broker.tracing.carry(message)  # the relay publishes it in this trace
        exchange, routing_key, mandatory = self.broker.route(message.destination)
        mandatory = mandatory and not message.reply  # a reply is never declared
        return {
            "created_at": utcnow(), "port": port, "exchange": exchange,
            "routing_key": routing_key, "mandatory": mandatory, "body": message.body,
            # Declared before the publish, a topic's exchange too (a publish to an
            # exchange nobody declared is refused); a reply never is.
            "declare_queue": None if message.reply else message.destination,
            "properties": message.to_json(),
        }, message.properties

    def write(self, session: Session, port: str, messages: list[Outgoing]) -> list[Pending]:
        """Insert rows for ``messages`` in the caller's transaction (one round trip each)."""
        pending = []
        for message in messages:
            values, properties = self._row(port, message)
            row_id = session.execute(
                self.table.insert().values(values).returning(self.table.c.id)
            ).scalar_one()
            pending.append(Pending(int(row_id), values, properties))
        return pending

    def dispatch(self, publisher: Publisher, pending: list[Pending]) -> None:
        """Publish committed rows, then delete them (crash point ``outbox-dispatch`` lies between)."""
        if not pending:
            return
        errors = _publish_rows(publisher, [(p.values, p.properties) for p in pending],
                               after_first=lambda: crash_point("outbox-dispatch"))
        sent = [p for p, error in zip(pending, errors, strict=True) if error is None]
        if sent:
            with self.store.engine.begin() as conn:
                conn.execute(delete(self.table).where(self._written(sent)))
        failed = next((error for error in errors if error is not None), None)
        if failed is not None:  # the rows stay: the relay publishes them later
            raise failed

    def _written(self, pending: list[Pending]) -> Any:
        """The rows ``pending`` wrote, and no row written since under one of their ids.

        The relay may have published and deleted a row while its dispatch was
        still publishing it (a dispatch slower than ``outbox_relay_grace``). On a
        SQLite table made before the outbox asked for AUTOINCREMENT, the next row
        then took the same id, and a delete by id alone removed that row unsent:
        its ``created_at`` tells the two apart.
        """
        t = self.table
        return or_(*(and_(t.c.id == p.id, t.c.created_at == p.values["created_at"]) for p in pending))

    def relay(self, publisher: Publisher, *, grace: timedelta) -> int:
        """One round of the relay: publish waiting rows, then delete them; return how many were sent.

        Rows of code outside handlers (:data:`ANY_CODE`) go at once; a handler's
        only once older than ``grace`` (``outbox_relay_grace``): a younger one may
        be one its consumer is publishing now. Rows go in id order, so the sends
        of one transaction keep their order. On PostgreSQL the caller holds the
        fleet's relay lock (:class:`Listener`); the rows are locked too and locked
        ones skipped. On SQLite the round takes the write lock before it reads
        (``BEGIN IMMEDIATE``): one relay at a time across processes, and its
        delete can never fail on a snapshot another writer made stale after its
        publish (which left published rows to be published again).

        A row the broker will not take (unroutable, not confirmed) is skipped and
        retried next time, so one bad row never blocks the rows behind it. A
        relay killed between the publish and the delete (crash point
        ``outbox-relay``) leaves the rows: published again, with the same ids.
        """
        query = self._waiting_rows(utcnow() - grace)
        if self.store.dialect != "postgresql" and not self._any_waiting(query):
            return 0  # no write lock for an empty round
        sent: list[int] = []
        with self._round() as conn:
            rows = conn.execute(query).all()
            parsed = [(row._asdict(), json.loads(row.properties)) for row in rows]
            errors = _publish_rows(publisher, parsed) if parsed else []
            if parsed:
                crash_point("outbox-relay")
            for (values, properties), error in zip(parsed, errors, strict=True):
                if error is not None:
                    log.log(self._level_for(values["id"]),
                            "outbox row %d (message %s) not published, retried later: %s",
                            values["id"], properties.get("message_id"), error)
                    continue
                sent.append(values["id"])
            if sent:
                conn.execute(delete(self.table).where(self.table.c.id.in_(sent)))
        if sent:
            log.debug("outbox relay published %d message(s)", len(sent))
        return len(sent)

    def _level_for(self, row_id: int) -> int:
        """WARNING for a row the broker refuses, then DEBUG for a minute: the relay sweeps every
        ``outbox_relay_interval``, and a row that waits for its queue would fill the log."""
        now = time.monotonic()
        if now - self._warned.get(row_id, -WARN_AGAIN) < WARN_AGAIN:
            return logging.DEBUG
        if len(self._warned) > 10_000:
            self._warned.clear()
        self._warned[row_id] = now
        return logging.WARNING

    def _waiting_rows(self, cutoff: Any) -> Any:
        t = self.table
        query = (select(t).where(or_(t.c.port == ANY_CODE, t.c.created_at < cutoff))
                 .order_by(t.c.id).limit(RELAY_BATCH))
        if self.store.dialect == "postgresql":
            query = query.with_for_update(skip_locked=True)
        return query

    def _any_waiting(self, query: Any) -> bool:
        with self.store.engine.connect() as conn:
            return conn.execute(select(query.limit(1).subquery().c.id)).first() is not None

    @contextmanager
    def _round(self) -> Iterator[Any]:
        """A transaction for one round; on SQLite it holds the write lock from its start."""
        with self.store.engine.connect() as conn:
            if self.store.dialect == "sqlite":
                conn.execution_options(sqlite_begin="IMMEDIATE")
            with conn.begin():
                yield conn

    def waiting(self) -> Waiting:
        """How many sends wait in the outbox, and the age of the oldest (one query)."""
        t = self.table
        with self.store.engine.connect() as conn:
            count, oldest = conn.execute(select(func.count(), func.min(t.c.created_at))).one()
        if not count or oldest is None:
            return Waiting(0, 0.0)
        if oldest.tzinfo is None:  # SQLite keeps no zone: the store writes UTC
            oldest = oldest.replace(tzinfo=utcnow().tzinfo)
        return Waiting(int(count), max(0.0, (utcnow() - oldest).total_seconds()))

    def backlog(self) -> int:
        return self.waiting().count

    def create_tables(self) -> None:
        """The container's tables where missing (``mdb run`` and ``mdb relay`` create them too)."""
        self.store.create_tables()


class Listener:
    """The relay's own PostgreSQL connection: it holds the fleet's relay lock and hears commits.

    A session advisory lock (:data:`RELAY_LOCK_CLASS`, keyed by the table) makes
    its holder the one relay of the fleet until its connection ends; a relay
    that dies loses it with its connection, and another takes it over on its
    next try. The holder listens on the table's channel, which every
    :meth:`Outbox.send` notifies in its own transaction: PostgreSQL delivers
    the notification at the commit, never for a rollback.
    """

    def __init__(self, outbox: Outbox) -> None:
        self.outbox = outbox
        pooled = outbox.store.engine.raw_connection()
        pooled.detach()  # held for the relay's life and closed with it, never handed back
        self._raw = pooled
        dbapi: Any = pooled.dbapi_connection
        dbapi.autocommit = True
        self._dbapi = dbapi
        self.leading = False

    def lead(self) -> bool:
        """Take the fleet's relay if no one holds it, and listen; True while this one holds it."""
        if self.leading:
            return True
        cursor = self._dbapi.cursor()
        try:
            cursor.execute(f"SELECT pg_try_advisory_lock({RELAY_LOCK_CLASS}, hashtext(%s))",
                           (self.outbox.qualified_name,))
            row = cursor.fetchone()
            self.leading = bool(row and row[0])
            if self.leading:
                cursor.execute('LISTEN "{}"'.format(self.outbox.channel.replace('"', '""')))
        finally:
            cursor.close()
        return self.leading

    def wait(self, timeout: float) -> bool:
        """Sleep until a commit notifies or ``timeout`` passes; True when told (all heard at once)."""
        if not callable(self._dbapi.notifies):  # psycopg2: a list that poll() fills
            return self._wait_psycopg2(timeout)
        told = False
        for _notice in self._dbapi.notifies(timeout=timeout, stop_after=1):
            told = True
        if told:  # the others of the same burst: one round publishes them all
            for _notice in self._dbapi.notifies(timeout=0.0):
                pass
        return told

    def _wait_psycopg2(self, timeout: float) -> bool:
        import select

        if select.select([self._dbapi], [], [], timeout) == ([], [], []):
            return False
        self._dbapi.poll()
        told = bool(self._dbapi.notifies)
        self._dbapi.notifies.clear()
        return told

    def close(self) -> None:
        try:
            self._raw.close()
        except Exception as exc:  # a connection the server already ended
            log.debug("relay listener connection not closed cleanly: %s", exc)
