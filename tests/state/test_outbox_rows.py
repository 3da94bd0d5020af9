"""Outbox rows (``state.outbox``): a send inside a unit of work leaves only after the commit.

The row commits with the work, is published with the broker's confirm and
deleted; a rolled-back unit sends nothing; rows a crash left behind are
published by the relay, once they are older than its grace.
"""

from __future__ import annotations

import json
from datetime import timedelta

from sqlalchemy.schema import CreateTable, DropTable

from mdbcontainer.settings import Settings
from mdbcontainer.state.outbox import Outbox
from mdbcontainer.state.store import Store
from mdbcontainer.support.outgoing import outgoing
from mdbcontainer.wire.connection import Broker
from mdbcontainer.wire.publisher import Publisher
from mdbcontainer.wire.queues import QueueSession
from tests.conftest import Backend


def _setup(backend: Backend, settings: Settings, store: Store) -> tuple[Outbox, Broker, str]:
    broker, queue = Broker(settings), backend.q("OUT")
    with QueueSession(broker) as session:
        session.declare(queue)  # the downstream port's queue
    return Outbox(store, broker), broker, queue


def test_a_committed_row_is_published_with_its_id_then_deleted(backend: Backend, settings: Settings,
                                                                store: Store) -> None:
    outbox, broker, queue = _setup(backend, settings, store)
    with store.sessions() as session, session.begin():
        pending = outbox.write(session, "Orders", [outgoing(queue, {"n": 1}, message_id="sent-1")])
        assert outbox.backlog() == 0, "the row is not there before the commit"
    assert outbox.backlog() == 1
    with Publisher(broker) as publisher, QueueSession(broker) as session_q:
        outbox.dispatch(publisher, pending)
        [message] = session_q.take(queue)
    assert message.message_id == "sent-1" and json.loads(message.body) == {"n": 1}
    assert outbox.backlog() == 0, "published, then deleted"


def test_a_rolled_back_unit_sends_nothing(backend: Backend, settings: Settings, store: Store) -> None:
    outbox, broker, queue = _setup(backend, settings, store)
    with store.sessions() as session, session.begin():
        outbox.write(session, "Orders", [outgoing(queue, {"n": 1})])
        session.rollback()
    assert outbox.backlog() == 0
    with Publisher(broker) as publisher:
        assert outbox.relay(publisher, grace=timedelta(0)) == 0


def test_the_relay_publishes_rows_a_crash_left_once_past_the_grace(backend: Backend, settings: Settings,
                                                                     store: Store) -> None:
    outbox, broker, queue = _setup(backend, settings, store)
    with store.sessions() as session, session.begin():  # committed; the process died before dispatch
        outbox.write(session, "Orders", [outgoing(queue, {"n": i}, message_id=f"left-{i}") for i in range(3)])
    with Publisher(broker) as publisher, QueueSession(broker) as session_q:
        assert outbox.relay(publisher, grace=timedelta(hours=1)) == 0, "young rows may be in flight"
        assert outbox.backlog() == 3
        assert outbox.relay(publisher, grace=timedelta(0)) == 3
        ids = [m.message_id for m in session_q.take(queue)]
    assert ids == ["left-0", "left-1", "left-2"], "in the order they were written"
    assert outbox.backlog() == 0


def _overtaken(outbox: Outbox, broker: Broker, queue: str, store: Store) -> list[str]:
    """A dispatch the relay overtook (it published and deleted the row first), then a new row:
    the dispatch deletes what it published and nothing else. Returns what the queue got."""
    with store.sessions() as session, session.begin():
        slow = outbox.write(session, "Orders", [outgoing(queue, {"n": 1}, message_id="slow-1")])
    with Publisher(broker) as publisher, QueueSession(broker) as session_q:
        assert outbox.relay(publisher, grace=timedelta(0)) == 1, "the relay overtook the dispatch"
        with store.sessions() as session, session.begin():
            outbox.write(session, "Orders", [outgoing(queue, {"n": 2}, message_id="next-2")])
        outbox.dispatch(publisher, slow)  # published a second time: the dedup table absorbs it
        assert outbox.backlog() == 1, "the row written since is still waiting, not deleted unsent"
        assert outbox.relay(publisher, grace=timedelta(0)) == 1
        return sorted(m.message_id for m in session_q.take(queue))


def test_a_dispatch_the_relay_overtook_never_deletes_a_row_written_since(
        backend: Backend, settings: Settings, store: Store) -> None:
    outbox, broker, queue = _setup(backend, settings, store)
    assert _overtaken(outbox, broker, queue, store) == ["next-2", "slow-1", "slow-1"]


def test_on_a_sqlite_outbox_made_without_autoincrement_an_id_used_again_is_not_deleted(
        embedded: Backend) -> None:
    """Tables an earlier release made: SQLite gives the next row the id of the one just deleted."""
    settings = embedded.settings(embedded.write(ports={}))
    store = Store(settings.container)
    try:
        store.create_tables()
        outbox = Outbox(store, Broker(settings))
        table = outbox.table
        with store.engine.begin() as conn:  # the table as it was made before: no AUTOINCREMENT
            ddl = str(CreateTable(table).compile(store.engine))
            conn.execute(DropTable(table))
            conn.exec_driver_sql(ddl.replace("AUTOINCREMENT", ""))
            assert "AUTOINCREMENT" in ddl, "the outbox asks SQLite for ids never used again"
        _, broker, queue = _setup(embedded, settings, store)
        assert _overtaken(outbox, broker, queue, store) == ["next-2", "slow-1", "slow-1"]
    finally:
        store.dispose()
