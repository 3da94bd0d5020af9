"""Outbox rows (``state.outbox``): a send inside a unit of work leaves only after the commit.

The row commits with the work, is published with the broker's confirm and
deleted; a rolled-back unit sends nothing; rows a crash left behind are
published by the relay, once they are older than its grace.
"""

from __future__ import annotations

import json
from datetime import timedelta

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
