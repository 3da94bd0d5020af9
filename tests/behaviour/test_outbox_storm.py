"""2,000 outbox sends from 20 concurrent transactions, the broker restarted in the middle.

Every committed send is applied downstream exactly once (port ``Downstream``,
once-only): the relay's publishes that the restart cut off stay in the outbox
and go again once the broker is back, and a copy published twice is applied
once.

It restarts the machine's RabbitMQ (``rabbitmqctl stop_app`` / ``start_app``),
so it is ``disruptive``. With ``MDB_OUTBOX_STORM_NODE=1`` it starts a RabbitMQ
node of its own on spare ports (tests/chaos/cluster.py) and restarts that one
instead, leaving the machine's broker alone.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from sqlalchemy.orm import Session

from mdbcontainer import Outbox
from mdbcontainer.testing import wait_for
from tests.chaos.cluster import Cluster, available
from tests.chaos.faults import restart_broker_app
from tests.conftest import Backend

pytestmark = [pytest.mark.disruptive, pytest.mark.slow, pytest.mark.rabbitmq, pytest.mark.postgres,
              pytest.mark.timeout(400)]

TRANSACTIONS = 20
SENDS = 100


@pytest.fixture
def broker() -> Iterator[tuple[str | None, Callable[[], None]]]:
    """The broker URL to use (None: the machine's) and how to restart it."""
    if not os.environ.get("MDB_OUTBOX_STORM_NODE"):
        def restart_machine_broker() -> None:
            restart_broker_app(pause=1.0)

        yield None, restart_machine_broker
        return
    why = available()
    if why:
        pytest.fail(why)
    node = Cluster(size=1)
    try:
        node.start()
        only = node.nodes[0]

        def restart() -> None:
            node.ctl(only, "stop_app")
            time.sleep(1.0)
            node.ctl(only, "start_app")
            node.ctl(only, "await_startup")

        yield only.url, restart
    finally:
        node.remove()


def test_every_committed_send_is_applied_once_across_a_broker_restart(
        rabbit: Backend, broker: tuple[str | None, Callable[[], None]]) -> None:
    url, restart = broker
    if url is not None:
        rabbit.broker_url = url
    queue = rabbit.q("DOWN")
    settings = rabbit.write(ports={"Downstream": {"destination": queue, "prefetch": 50}},
                            queues={queue: {}}, outbox_relay_interval="200ms")
    outbox = Outbox.from_settings(rabbit.settings(settings))
    ids = {f"t{t}-{n}" for t in range(TRANSACTIONS) for n in range(SENDS)}
    with rabbit.container(settings) as container:

        def transaction(t: int) -> None:
            time.sleep(0.25 * t)  # the commits spread over five seconds, the restart among them
            with Session(rabbit.engine) as session, session.begin():
                for n in range(SENDS):
                    outbox.send(session, queue, {"action": "ok", "n": n}, message_id=f"t{t}-{n}")
                    if n % 25 == 0:
                        time.sleep(0.02)  # held open while the others send: concurrent transactions

        senders = [threading.Thread(target=transaction, args=(t,)) for t in range(TRANSACTIONS)]
        for sender in senders:
            sender.start()
        wait_for(lambda: len(rabbit.effects("Downstream")) >= 300, timeout=60,
                 what="the first sends applied")
        restart()
        for sender in senders:
            sender.join(120)
        wait_for(lambda: len(rabbit.effects("Downstream")) == len(ids), timeout=240, interval=1.0,
                 what="every committed send applied")
        wait_for(lambda: outbox.waiting().count == 0, timeout=60, what="the outbox emptied")
        time.sleep(2.0)  # a copy published twice would be applied by now, if it were applied twice
        assert container.alive()
    outbox.store.dispose()
    effects = rabbit.effects("Downstream")
    assert set(effects) == ids, "nothing lost, nothing unexpected"
    assert [i for i, count in effects.items() if count > 1] == [], "nothing applied twice"
