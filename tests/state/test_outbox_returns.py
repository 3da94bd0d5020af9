"""The outbox after a return: the unroutable send's row stays, the routable one's goes (issue 27, item 5).

One unit of work sends one message id twice: to a queue that takes it and to a
queue deleted since the publisher declared it. After the dispatch the routable
send is on its queue and its row deleted; the returned send's row is kept for
the relay. Blaming the return on the wrong send (by message id) would do the
opposite: lose the unroutable send and relay the routable one again.
"""

from __future__ import annotations

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from mdbcontainer.errors import Unroutable
from mdbcontainer.state.outbox import Outbox
from mdbcontainer.state.store import Store
from mdbcontainer.support.outgoing import outgoing
from mdbcontainer.wire.connection import Broker
from mdbcontainer.wire.publisher import Publisher
from tests.conftest import Backend


@pytest.mark.rabbitmq
@pytest.mark.postgres
def test_a_returned_send_keeps_its_own_outbox_row_when_two_sends_share_an_id(rabbit: Backend) -> None:
    kept, gone = rabbit.q("KEPT"), rabbit.q("GONE")
    path = rabbit.write(ports={"Work": {"destination": kept}}, queues={kept: {}, gone: {}})
    settings = rabbit.settings(path)
    store = Store(settings.container)
    store.create_tables()
    broker = Broker(settings)
    outbox = Outbox(store, broker)
    publisher = Publisher(broker)
    try:
        publisher.route(kept)
        publisher.route(gone)
        publisher.channel.queue_delete(queue=gone)  # deleted since the publisher declared it
        with Session(store.engine) as session, session.begin():
            pending = outbox.write(session, "Work", [outgoing(gone, {"n": 1}, message_id="shared"),
                                                     outgoing(kept, {"n": 1}, message_id="shared")])
        with pytest.raises(Unroutable):
            outbox.dispatch(publisher, pending)
        with store.engine.connect() as conn:
            left = [row.routing_key for row in conn.execute(select(outbox.table))]
    finally:
        publisher.close()
        store.dispose()
    assert left == [gone], "the unroutable send stays for the relay; the routable one is done"
    assert rabbit.probe(path).count(kept) == 1
