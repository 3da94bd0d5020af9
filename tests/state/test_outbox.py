"""``Outbox.send`` from code outside handlers, in the test's process, on both databases.

The caller's own ``Session`` or ``AsyncSession`` writes the row; a relay (the
one ``mdb run`` and ``mdb relay`` run, here on a thread) publishes it. Read
back from the broker: what a rolled-back transaction sent never arrives, what
a committed one sent arrives exactly, in the order it was sent; a session of
another database is refused before anything is written; on PostgreSQL the
relay is told at the commit (it publishes long before its sweep would).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, func, select, text
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from mdbcontainer import Outbox, PublishError, TransactionError
from mdbcontainer.runtime.relay import Relay
from mdbcontainer.settings import Settings
from mdbcontainer.state.outbox import Listener
from mdbcontainer.state.store import async_url
from mdbcontainer.support.outgoing import outgoing
from mdbcontainer.testing import QueueProbe, wait_for
from mdbcontainer.wire.connection import Broker
from mdbcontainer.wire.publisher import Publish, Publisher
from tests.conftest import Backend


def outbox_settings(backend: Backend, queue: str, **container: str) -> Settings:
    path = backend.write(ports={}, queues={queue: {}}, listeners=[], **container)
    return backend.settings(path)


@contextmanager
def relaying(settings: Settings, outbox: Outbox) -> Iterator[None]:
    stop = threading.Event()
    worker = threading.Thread(target=Relay(settings, outbox, stop).run, daemon=True)
    worker.start()
    try:
        yield
    finally:
        stop.set()
        worker.join(10)


def bodies(probe: QueueProbe, queue: str, count: int) -> list[dict[str, int]]:
    """Wait for ``count`` messages on ``queue``, then take them all, in their order."""
    wait_for(lambda: probe.exists(queue) and probe.count(queue) >= count, timeout=20,
             what=f"{count} message(s) on {queue}")
    time.sleep(0.3)  # anything more than expected would be there by now
    import json

    return [json.loads(d.body) for d in probe.take_all(queue)]


def waiting_rows(outbox: Outbox) -> int:
    return outbox.waiting().count


def test_a_rollback_sends_nothing_and_a_commit_its_sends_in_order(backend: Backend) -> None:
    queue = backend.q("ORDERS")
    settings = outbox_settings(backend, queue)
    outbox = Outbox.from_settings(settings)
    outbox.create_tables()
    probe = QueueProbe(settings)
    engine = create_engine(backend.database_url)
    try:
        with Session(engine) as session, session.begin():
            for n in range(3):
                outbox.send(session, queue, {"n": -n})
            session.rollback()
        with Session(engine) as session, session.begin():
            ids = [outbox.send(session, queue, {"n": n}, message_id=f"order-{n}") for n in range(20)]
        assert ids == [f"order-{n}" for n in range(20)], "send returns the message id"
        with relaying(settings, outbox):
            assert bodies(probe, queue, 20) == [{"n": n} for n in range(20)], \
                "exactly the committed sends, in the order they were made"
            wait_for(lambda: waiting_rows(outbox) == 0, what="the outbox emptied")
    finally:
        probe.close()
        engine.dispose()
        outbox.store.dispose()


def test_an_async_session_sends_at_its_commit_and_nothing_on_rollback(backend: Backend) -> None:
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

    queue = backend.q("EVENTS")
    settings = outbox_settings(backend, queue)
    outbox = Outbox.from_settings(settings)
    outbox.create_tables()
    probe = QueueProbe(settings)

    async def sends() -> None:
        engine = create_async_engine(async_url(backend.database_url))
        try:
            async with AsyncSession(engine) as session, session.begin():
                outbox.send(session, queue, {"n": -1})
                await session.rollback()
            async with AsyncSession(engine) as session, session.begin():
                for n in range(5):
                    outbox.send(session, queue, {"n": n})  # the same plain call as with a Session
                assert waiting_rows(outbox) == 0, "nothing written before the commit"
        finally:
            await engine.dispose()

    try:
        asyncio.run(sends())
        assert waiting_rows(outbox) == 5
        with relaying(settings, outbox):
            assert bodies(probe, queue, 5) == [{"n": n} for n in range(5)]
    finally:
        probe.close()
        outbox.store.dispose()


def test_a_session_of_another_database_is_refused_before_anything_is_written(
        backend: Backend, tmp_path: Path) -> None:
    queue = backend.q("ORDERS")
    settings = outbox_settings(backend, queue)
    outbox = Outbox.from_settings(settings)
    outbox.create_tables()
    if backend.kind == "rabbitmq":
        elsewhere = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
    else:
        elsewhere = f"sqlite:///{tmp_path / 'other.db'}"
    engine = create_engine(elsewhere)
    try:
        with Session(engine) as session, session.begin():
            with pytest.raises(TransactionError) as refused:
                outbox.send(session, queue, {"n": 1})
            assert session.get_transaction() is not None, "the caller's transaction goes on"
        line = str(refused.value)
        assert "\n" not in line
        assert elsewhere.rsplit("/", 1)[-1] in line, "it names the session's database"
        assert backend.database_url.rsplit("/", 1)[-1] in line, "and the container's"
        assert waiting_rows(outbox) == 0, "nothing written"
    finally:
        engine.dispose()
        outbox.store.dispose()


@pytest.mark.rabbitmq
@pytest.mark.postgres
def test_on_postgresql_the_relay_is_told_at_commit(rabbit: Backend) -> None:
    """With a sweep every 30 s, only the commit's notification can publish within seconds."""
    queue = rabbit.q("FAST")
    settings = outbox_settings(rabbit, queue, outbox_relay_interval="30s")
    outbox = Outbox.from_settings(settings)
    outbox.create_tables()
    probe = QueueProbe(settings)
    engine = create_engine(rabbit.database_url)
    try:
        with relaying(settings, outbox):
            time.sleep(1.0)  # the relay holds the lock and listens
            latencies = []
            for n in range(5):
                with Session(engine) as session, session.begin():
                    outbox.send(session, queue, {"n": n})
                committed = time.monotonic()
                wait_for(lambda: waiting_rows(outbox) == 0, timeout=10, interval=0.005,
                         what="the send published")
                latencies.append(time.monotonic() - committed)
            assert max(latencies) < 5.0, f"published {latencies} s after the commits: not told"
            assert bodies(probe, queue, 5) == [{"n": n} for n in range(5)]
    finally:
        probe.close()
        engine.dispose()
        outbox.store.dispose()


def test_the_outbox_counts_waiting_sends_and_the_oldest_age(backend: Backend) -> None:
    queue = backend.q("WAIT")
    settings = outbox_settings(backend, queue)
    outbox = Outbox.from_settings(settings)
    outbox.create_tables()
    engine = create_engine(backend.database_url)
    try:
        assert outbox.waiting().count == 0 and outbox.waiting().oldest_seconds == 0.0
        with Session(engine) as session, session.begin():
            outbox.send(session, queue, "one")
            outbox.send(session, queue, "two")
        time.sleep(0.5)
        waiting = outbox.waiting()
        assert waiting.count == 2 and 0.4 < waiting.oldest_seconds < 30
        with engine.connect() as conn:
            table = outbox.table
            assert conn.execute(select(func.count()).select_from(table)).scalar() == 2
    finally:
        engine.dispose()
        outbox.store.dispose()


class _WriteDuringPublish(Publisher):
    """The real publisher; once its publish is confirmed, another connection commits a write."""

    def __init__(self, settings: Settings, database_url: str) -> None:
        super().__init__(Broker(settings))
        self.other = create_engine(database_url)
        self.writer: threading.Thread | None = None

    def publish_many(self, items: list[Publish], **kwargs: Any) -> list[PublishError | None]:
        errors = super().publish_many(items, **kwargs)

        def write() -> None:
            with self.other.begin() as conn:  # a consumer committing its own work meanwhile
                conn.execute(text("CREATE TABLE IF NOT EXISTS elsewhere (n INTEGER)"))
                conn.execute(text("INSERT INTO elsewhere VALUES (1)"))

        self.writer = threading.Thread(target=write)
        self.writer.start()
        self.writer.join(1.0)  # it commits now, unless the relay holds the write lock
        return errors


def test_a_write_committed_during_a_relay_round_on_sqlite_does_not_make_it_publish_twice(
        embedded: Backend) -> None:
    """Issue 27: the relay read in a deferred transaction, published, then failed its delete on a
    snapshot another writer had made stale (SQLITE_BUSY at once): the rows, published, stayed,
    and the next round published them again."""
    queue = embedded.q("TWICE")
    settings = outbox_settings(embedded, queue)
    outbox = Outbox.from_settings(settings)
    outbox.create_tables()
    with outbox.store.sessions() as session, session.begin():
        outbox.write(session, "Handler", [outgoing(queue, {"n": n}) for n in range(2)])
    time.sleep(0.05)
    publisher = _WriteDuringPublish(settings, embedded.database_url)
    probe = QueueProbe(settings)
    try:
        sent = 0
        for _round in range(3):
            with suppress(OperationalError):
                sent += outbox.relay(publisher, grace=timedelta(0))
        assert publisher.writer is not None
        publisher.writer.join(10)
        assert len(bodies(probe, queue, 2)) == 2, "each row published once"
        assert outbox.waiting().count == 0 and sent == 2, "and removed by the round that published it"
    finally:
        publisher.close()
        publisher.other.dispose()
        probe.close()
        outbox.store.dispose()


@pytest.mark.rabbitmq
@pytest.mark.postgres
def test_one_relay_per_outbox_table_not_one_per_database(rabbit: Backend) -> None:
    """Issue 27: the relay's lock was one constant per database, so the services of one database
    that keep their tables in schemas of their own had one relay among them all."""
    other = f"{rabbit.schema}_b"
    with rabbit.engine.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{other}"'))
    queue = rabbit.q("ORDERS")
    mine = Outbox.from_settings(outbox_settings(rabbit, queue))
    theirs = Outbox.from_settings(outbox_settings(rabbit, queue, db_schema=other))
    again = Outbox.from_settings(outbox_settings(rabbit, queue))
    listeners = [Listener(mine), Listener(theirs), Listener(again)]
    try:
        assert listeners[0].lead(), "the first relay of this table leads"
        assert listeners[1].lead(), "the table of another schema has a relay of its own"
        assert not listeners[2].lead(), "a second relay of the same table waits"
        listeners[0].close()
        wait_for(listeners[2].lead, what="the waiting relay takes over once the first is gone")
    finally:
        for listener in listeners:
            listener.close()
        for outbox in (mine, theirs, again):
            outbox.store.dispose()
        with rabbit.engine.begin() as conn:
            conn.execute(text(f'DROP SCHEMA IF EXISTS "{other}" CASCADE'))


def test_the_trace_context_current_at_send_travels_with_the_message(
        embedded: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    """Section 13: the consumer of a send made in a web request's span joins that trace."""
    from opentelemetry import trace

    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    queue = embedded.q("TRACED")
    settings = outbox_settings(embedded, queue, tracing="true")
    outbox = Outbox.from_settings(settings)  # sets the SDK up (no exporter here)
    outbox.create_tables()
    probe = QueueProbe(settings)
    engine = create_engine(embedded.database_url)
    try:
        request = trace.get_tracer("web").start_as_current_span("POST /orders")
        with request as span, Session(engine) as session, session.begin():
            outbox.send(session, queue, {"n": 1})
        trace_id = format(span.get_span_context().trace_id, "032x")
        with relaying(settings, outbox):
            wait_for(lambda: probe.exists(queue) and probe.count(queue) == 1, what="the send")
            (delivered,) = probe.take_all(queue)
        traceparent = str(delivered.headers.get("traceparent", ""))
        assert traceparent.split("-")[1:2] == [trace_id], (traceparent, trace_id)
    finally:
        probe.close()
        engine.dispose()
        outbox.store.dispose()


def test_a_relay_interval_below_10ms_is_refused_naming_the_key(embedded: Backend) -> None:
    from mdbcontainer import SettingsError

    path = embedded.write(ports={}, listeners=[], outbox_relay_interval="1ms")
    with pytest.raises(SettingsError, match="outbox_relay_interval") as refused:
        embedded.settings(path)
    assert "\n" not in str(refused.value)
