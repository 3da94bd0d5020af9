"""One container of a fleet at a time relays the outbox (README: Running in production).

The dedup purge's own lock is pinned in test_dedup.py; the relay's is here:
while another container relays (it holds the fleet's relay lock), a relay
publishes nothing, so no row leaves twice; once that one is done, the rows go.
"""

from __future__ import annotations

from datetime import timedelta

import pytest

from mdbcontainer.state.outbox import RELAY_LOCK, Outbox
from mdbcontainer.state.store import Store
from mdbcontainer.support.outgoing import Outgoing
from mdbcontainer.wire.connection import Broker
from mdbcontainer.wire.publisher import Publisher
from tests.conftest import Backend


@pytest.mark.rabbitmq
@pytest.mark.postgres
def test_one_outbox_relay_at_a_time_across_the_fleet(rabbit: Backend) -> None:
    queue = rabbit.q("RELAYED")
    path = rabbit.write(ports={"Work": {"destination": rabbit.q("W")}}, queues={queue: {}})
    settings = rabbit.settings(path)
    store = Store(settings.container)
    store.create_tables()
    outbox = Outbox(store, Broker(settings))
    with store.sessions() as session, session.begin():
        outbox.write(session, "Work", [
            Outgoing(queue, b'{"n": %d}' % i, {"message_id": f"relay-{i}"}) for i in range(3)
        ])
    probe = rabbit.probe(path)
    try:
        with Publisher(Broker(settings)) as pub, store.engine.connect() as other:
            other.exec_driver_sql(f"SELECT pg_advisory_lock({RELAY_LOCK})")  # another relay runs
            assert outbox.relay(pub, grace=timedelta(0)) == 0
            assert outbox.backlog() == 3 and not probe.exists(queue)
            other.exec_driver_sql(f"SELECT pg_advisory_unlock({RELAY_LOCK})")
            assert outbox.relay(pub, grace=timedelta(0)) == 3
        assert outbox.backlog() == 0
        ids = sorted(m.properties["message_id"] for m in probe.take_all(queue))
        assert ids == ["relay-0", "relay-1", "relay-2"]
    finally:
        store.dispose()
