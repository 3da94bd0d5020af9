"""Transient infrastructure faults are not poison (README: Guarantees).

A lost database or broker connection during a delivery is the infrastructure's
fault, not the message's: the container waits it out, logs it once, counts
nothing against the message or the port, and handles the message exactly once
afterwards. The faults are aimed at the one container under test (its own
PostgreSQL login role, its own broker connections), so the tests running
beside these ones are untouched.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mdbcontainer.state.control import Control
from mdbcontainer.state.store import Store
from mdbcontainer.testing import ContainerProcess, wait_for
from tests.chaos import faults
from tests.conftest import Backend


def on_services(test: Any) -> Any:
    """RabbitMQ + PostgreSQL, a few seconds, no other run stopping a service meanwhile."""
    quiet = pytest.mark.usefixtures("no_service_stops")
    for mark in (pytest.mark.slow, pytest.mark.rabbitmq, pytest.mark.postgres, quiet):
        test = mark(test)
    return test


@pytest.fixture
def no_service_stops() -> Iterator[None]:
    """These tests count outage lines: no other run may stop a service meanwhile (shared lock)."""
    with faults.disruptive_lock(shared=True):
        yield


@pytest.fixture
def role() -> Iterator[faults.DatabaseRole]:
    """A PostgreSQL login role for the container under test alone."""
    role = faults.DatabaseRole().create()
    yield role
    role.drop()


def strict_settings(rabbit: Backend, role: faults.DatabaseRole, **port: object) -> tuple[Path, str]:
    """Port Work with no tolerance at all: one counted failure stops it and backs the message out."""
    queue = rabbit.q("WORK")
    settings = rabbit.write(
        ports={"Work": {"destination": queue, "max_retries": 0, **port}},
        queues={queue: {"backout_threshold": 1}},
        database_url=role.url,
    )
    return settings, queue


def send(rabbit: Backend, settings: Path, queue: str, *messages: tuple[str, dict]) -> None:
    with rabbit.producer(settings) as producer:
        for message_id, body in messages:
            producer.send(queue, body, message_id=message_id)


def port_row(rabbit: Backend, settings: Path, container: ContainerProcess) -> dict[str, Any]:
    """Port Work as ``mdb ports`` shows it, read as postgres (the container's own role may be refused)."""
    store = Store(rabbit.settings(settings).container, engine=rabbit.engine)
    rows = [r for r in Control(store).live() if f":{container.pid}:" in r["container"]]
    return next((r for r in rows if r["port"] == "Work"), {})


def assert_nothing_counted(rabbit: Backend, settings: Path, container: ContainerProcess) -> None:
    """No redelivery count, no failed delivery, no backout, and the port started."""
    assert {a[3] for a in rabbit.attempts()} == {0}, f"counted: {rabbit.attempts()}"
    state = port_row(rabbit, settings, container)
    assert state.get("state") == "started", state
    assert (state.get("failed"), state.get("consecutive_failures"), state.get("backed_out")) == (0, 0, 0)
    assert rabbit.probe(settings).count(rabbit.q("DLQ")) == 0


@on_services
def test_lost_database_connection_mid_delivery_is_waited_out_and_counts_nothing(
    rabbit: Backend, role: faults.DatabaseRole,
) -> None:
    settings, queue = strict_settings(rabbit, role, prefetch=1)
    with rabbit.container(settings) as container:
        send(rabbit, settings, queue, ("slow", {"n": 1, "action": "sleep", "seconds": 2}))
        wait_for(lambda: rabbit.attempts(), what="the handler to start")
        with role.refused() as cut:  # the handler's transaction dies under it
            assert cut >= 1
            wait_for(lambda: "database unavailable" in container.output(), timeout=15,
                     what="the outage to be noticed")
            time.sleep(4)  # a few retries, each refused before the handler runs again
            assert len(rabbit.attempts()) == 1
            assert port_row(rabbit, settings, container)["state"] == "started"
        send(rabbit, settings, queue, ("after", {"n": 2}))
        wait_for(lambda: rabbit.effects() == {"slow": 1, "after": 1}, timeout=30,
                 what="both messages handled")
        wait_for(lambda: "database connection restored" in container.output(), what="the restored line")
        assert_nothing_counted(rabbit, settings, container)
        log = container.output()
    assert log.count("database unavailable") == 1, log
    assert log.count("database connection restored") == 1, log
    assert len([a for a in rabbit.attempts() if a[1] == "slow"]) == 2, "once cut, once after"


@on_services
def test_database_refusing_new_deliveries_holds_them_and_stops_nothing(
    rabbit: Backend, role: faults.DatabaseRole,
) -> None:
    settings, queue = strict_settings(rabbit, role, concurrency=2, prefetch=5)
    with rabbit.container(settings) as container:
        with role.refused():
            send(rabbit, settings, queue, *[(f"m-{i}", {"n": i}) for i in range(20)])
            wait_for(lambda: "database unavailable" in container.output(), timeout=15,
                     what="the outage to be noticed")
            time.sleep(3)
            assert rabbit.effects() == {}
        wait_for(lambda: len(rabbit.effects()) == 20, timeout=30, what="every message handled")
        assert set(rabbit.effects().values()) == {1}
        assert_nothing_counted(rabbit, settings, container)
        log = container.output()
    assert log.count("database unavailable") == 1, log
    assert log.count("database connection restored") == 1, log


@on_services
def test_lost_broker_connections_reconnect_and_count_nothing(rabbit: Backend,
                                                            role: faults.DatabaseRole) -> None:
    """The handlers in flight commit; their acknowledgments die with the connection, so the
    broker redelivers them: the dedup row absorbs each (duplicate_skipped), uncounted."""
    settings, queue = strict_settings(rabbit, role, concurrency=2, prefetch=5)
    ids = [f"m-{i:02d}" for i in range(30)]
    with rabbit.container(settings) as container:
        send(rabbit, settings, queue, *[(i, {"n": n, "action": "sleep", "seconds": 0.3})
                                        for n, i in enumerate(ids)])
        wait_for(lambda: len(rabbit.effects()) >= 4, what="deliveries in flight")
        before = faults.broker_ports_of(container.pid)
        closed = faults.close_broker_connections(container.pid)
        assert closed >= 2, "both consumers' connections"
        wait_for(lambda: "broker unavailable" in container.output(), what="the outage to be noticed")
        wait_for(lambda: sorted(rabbit.effects()) == ids, timeout=60, what="every message handled")
        container.wait_started(30)
        assert not faults.broker_ports_of(container.pid) & before, "new connections"
        assert set(rabbit.effects().values()) == {1}, "nothing applied twice"
        assert_nothing_counted(rabbit, settings, container)
        wait_for(lambda: port_row(rabbit, settings, container).get("duplicate_skipped", 0) >= 1,
                 what="the heartbeat to show the redelivery")
        assert rabbit.probe(settings).count(queue) == 0



def test_an_outage_is_logged_once_though_each_consumer_notices_it_on_its_own(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Consumers busy in a handler notice a lost connection after others have reconnected:
    those late reports are the same outage, unless the connection stays lost."""
    from mdbcontainer.pipeline import resources as module
    from mdbcontainer.settings import settings_from_dict
    from mdbcontainer.wire.connection import Broker

    monkeypatch.setattr(module, "OUTAGE_ECHO", 0.3)
    settings = settings_from_dict({"container": {"database_url": f"sqlite:///{tmp_path / 'c.db'}"}})
    resources = module.SharedResources(settings, Store(settings.container), Broker(settings))
    caplog.set_level("INFO", logger="mdbcontainer.resources")
    lost = ConnectionResetError("reset by peer")
    resources.outage("broker", lost)
    resources.outage("broker", lost)  # a second consumer, same moment
    resources.recovered("broker")
    resources.outage("broker", lost)  # a consumer that was busy in its handler
    resources.recovered("broker")
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == [
        "broker unavailable", "broker connection restored after 0.0s"]
    resources.outage("broker", lost)  # lost again at once, and this time for longer
    time.sleep(0.35)
    resources.outage("broker", lost)
    assert caplog.records[-1].levelname == "ERROR" and "broker unavailable" in caplog.messages[-1]
    assert "broker" in resources.outages


@on_services
def test_a_batch_without_transaction_holds_its_failure_count_through_a_database_outage(
    rabbit: Backend, role: faults.DatabaseRole,
) -> None:
    """``transaction = "none"``, batched: a message fails while the container's database is
    away. Its failure is counted once the database is back (then backed out), and the messages
    handled beside it are acknowledged once, never requeued and applied again."""
    queue = rabbit.q("NONE")
    settings = rabbit.write(
        ports={"Work": {"destination": queue, "transaction": "none", "batch_size": 5,
                        "batch_linger": "300ms", "max_retries": 5}},
        queues={queue: {"backout_threshold": 1}},
        database_url=role.url,
    )
    reached, go = rabbit.tmp / "reached", rabbit.tmp / "go"
    bodies: list[tuple[str, dict]] = [(f"g-{i}", {"n": i}) for i in range(5)]
    bodies[2] = ("bad", {"n": 2, "action": "fail", "pause": [str(reached), str(go)]})
    with rabbit.container(settings) as container:
        send(rabbit, settings, queue, *bodies)
        wait_for(reached.exists, what="the failing handler to start")
        with role.refused() as cut:
            assert cut >= 1
            go.touch()  # the handler fails now, with the container's database away
            wait_for(lambda: "database unavailable" in container.output(), timeout=15,
                     what="the outage to be noticed")
            time.sleep(3)
            assert rabbit.probe(settings).count(rabbit.q("DLQ")) == 0, "not counted yet"
        wait_for(lambda: rabbit.probe(settings).count(rabbit.q("DLQ")) == 1, timeout=30,
                 what="the failure counted and backed out")
        wait_for(lambda: port_row(rabbit, settings, container).get("handled") == 4, timeout=15,
                 what="the four others handled")
        row = port_row(rabbit, settings, container)
        log = container.output()
    assert row["state"] == "started" and row["failed"] == 1, row
    ran = [a[1] for a in rabbit.attempts()]
    assert sorted(ran) == ["bad", "g-0", "g-1", "g-3", "g-4"], f"each ran once: {ran}"
    assert "container error" not in log, log[-3000:]
    assert rabbit.probe(settings).count(queue) == 0
