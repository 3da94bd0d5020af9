"""A COMMIT whose answer never came, sessions cut in a loop, and a failover (CONTRACT: The record).

PostgreSQL runs on spare ports (tests/record/postgres.py), never the
machine's cluster. For the first two tests it is a primary alone with
``synchronous_standby_names = '*'`` and ``synchronous_commit = local`` for
its database: commits return at once, except a transaction that sets
``synchronous_commit = on`` (the test handlers' ``syncwait``), whose COMMIT
is on the primary's disk and then waits for a standby that never comes. Its
session is terminated there: the container sees its connection die during
COMMIT, its transaction in fact committed. A container that took that for a
failure would count a retry against the message (and a breach of "a
database outage is not the message's failure"); one that ran the handler
again without the dedup row deciding would apply it twice; one that
acknowledged anything before its commit was known would lose it when the
commit had failed, which the loop of terminations makes happen.

The third test fails the database over under a container (the primary
SIGKILLed, the standby promoted, the old primary rebuilt as its standby):
the container, on the libpq multi-host URL with
``target_session_attrs=read-write``, works on against the promoted primary
without a restart, and nothing is lost or applied twice. A write that
reaches the standby (read-only, SQLSTATE 25006) is an outage the delivery
waits out, never a failure counted against its message.
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import MetaData, create_engine, select, text
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError

from mdbcontainer.state.database import is_infrastructure
from mdbcontainer.testing import ContainerProcess, wait_for
from tests.conftest import Backend
from tests.record.postgres import Replicated, available

pytestmark = [pytest.mark.slow, pytest.mark.rabbitmq, pytest.mark.timeout(300)]

PORTS = {  # a once-only port of each kind, and its listener module
    "Work": ("tests.apps.work", {"transaction": "container"}),
    "Bean": ("tests.apps.bean", {"transaction": "bean"}),
    "AsyncWork": ("tests.apps.asyncwork", {"transaction": "container"}),
    "BatchWork": ("tests.apps.batchwork", {"transaction": "container", "batch_size": 5,
                                           "batch_linger": "50ms"}),
}


def servers(with_standby: bool) -> Iterator[Replicated]:
    why = available()
    if why:
        if os.environ.get("MDB_REQUIRE_SERVICES"):
            pytest.fail(why)
        pytest.skip(why)
    database = Replicated(synchronous=True, with_standby=with_standby)
    try:
        yield database.start()
    finally:
        database.remove()


@pytest.fixture
def lonely() -> Iterator[Replicated]:
    """A synchronous primary without its standby: only ``syncwait`` commits wait (for ever)."""
    for database in servers(with_standby=False):
        database.primary.sql(f"ALTER DATABASE {database.database} SET synchronous_commit = local")
        yield database


@pytest.fixture
def pair() -> Iterator[Replicated]:
    yield from servers(with_standby=True)


class Fleet:
    """One container with every port kind on the test's RabbitMQ queues and the spare database."""

    def __init__(self, rabbit: Backend, database: Replicated) -> None:
        self.rabbit, self.database = rabbit, database
        self.engine: Engine = create_engine(database.url, pool_pre_ping=True)
        with self.engine.begin() as conn:
            conn.execute(text(f'CREATE SCHEMA "{rabbit.schema}"'))
        from tests.apps import common

        md = MetaData(schema=rabbit.schema)
        for table in common.metadata.tables.values():
            table.to_metadata(md, schema=rabbit.schema)
        md.create_all(self.engine)
        self.effects = md.tables[f"{rabbit.schema}.effects"]
        self.queues = {port: rabbit.q(port.upper()) for port in PORTS}
        self.settings = rabbit.write(
            ports={port: {"destination": self.queues[port], "concurrency": 2, "max_retries": 100, **extra}
                   for port, (_module, extra) in PORTS.items()},
            queues={q: {"backout_threshold": 5} for q in self.queues.values()},
            listeners=sorted(module for module, _extra in PORTS.values()),
            database_url=database.url, heartbeat="2s", database_timeout="5s", connect_timeout="5s",
        )

    def container(self) -> ContainerProcess:
        return self.rabbit.container(self.settings)

    def send(self, ids: dict[str, str], **body: Any) -> None:
        with self.rabbit.producer(self.settings) as producer:
            for message_id, port in ids.items():
                producer.send(self.queues[port], {"n": 1, "action": "ok", **body}, message_id=message_id)

    def applied(self) -> Counter[tuple[str, str]]:
        with self.engine.connect() as conn:
            rows = conn.execute(select(self.effects.c.port, self.effects.c.message_id)).all()
        return Counter((str(port), str(message_id)) for port, message_id in rows)

    def left(self) -> int:
        probe = self.rabbit.probe(self.settings)
        return sum(probe.count(q) for q in self.queues.values())

    def backed_out(self) -> int:
        return self.rabbit.probe(self.settings).count(self.rabbit.q("DLQ"))

    def close(self) -> None:
        self.engine.dispose()


def ids_for(prefix: str, count: int) -> dict[str, str]:
    names = list(PORTS)
    return {f"{prefix}-{i}": names[i % len(names)] for i in range(count)}


def test_a_commit_whose_answer_never_came_is_applied_once_and_not_counted(
        rabbit: Backend, lonely: Replicated, tmp_path: Path) -> None:
    fleet = Fleet(rabbit, lonely)
    waiting = {f"wait-{port}": port for port in PORTS}
    try:
        with fleet.container() as container:
            for message_id, port in waiting.items():
                fleet.send({message_id: port}, syncwait=str(tmp_path / f"{message_id}.flag"))
            stuck = wait_for(lambda: len(found := lonely.sessions("wait_event = 'SyncRep'")) == len(PORTS)
                             and found, 60, what="every port's COMMIT waiting for the standby")
            before = fleet.applied()  # committed on the primary, not yet visible: still in their COMMIT
            for pid in stuck:
                lonely.primary.sql(f"SELECT pg_terminate_backend({pid})")
            wait_for(lambda: fleet.left() == 0 and len(fleet.applied()) == len(waiting), 60,
                     interval=0.5, what="the messages settled")
            fleet.send(ids_for("after", 8))  # the ports work on
            wait_for(lambda: len(fleet.applied()) == len(waiting) + 8, 60, interval=0.5,
                     what="the messages after it applied")
            output = container.output()
        attempts = Counter(a[1] for a in rabbit.attempts())
        applied, backed_out = fleet.applied(), fleet.backed_out()
    finally:
        fleet.close()
    assert not before, before
    assert applied == Counter({(port, m): 1 for m, port in {**waiting, **ids_for("after", 8)}.items()})
    # The dedup row decided: the handler never ran again, and no failure was counted.
    assert all(attempts[m] == 1 for m in waiting), attempts
    assert backed_out == 0
    assert "database unavailable (" in output and "database connection restored" in output, output[-3000:]
    assert "delivery failed" not in output, output[-3000:]


def test_sessions_terminated_in_a_loop_lose_nothing_and_apply_nothing_twice(
        rabbit: Backend, lonely: Replicated) -> None:
    fleet = Fleet(rabbit, lonely)
    ids = ids_for("loop", 400)
    stop = threading.Event()
    cut = Counter[str]()

    def terminate() -> None:
        while not stop.is_set():
            cut["sessions"] += lonely.terminate_backends()
            cut["rounds"] += 1
            time.sleep(0.15)

    try:
        with fleet.container() as container:
            cutter = threading.Thread(target=terminate, daemon=True)
            cutter.start()
            fleet.send(ids)
            time.sleep(6)
            stop.set()
            cutter.join(30)
            wait_for(lambda: fleet.left() == 0 and len(fleet.applied()) >= len(ids), 120, interval=0.5,
                     what="every message applied")
            time.sleep(2)  # anything applied twice is applied by now
            states = {row["port"]: row["state"] for row in container.rows()}
        applied, backed_out = fleet.applied(), fleet.backed_out()
    finally:
        fleet.close()
    print(f"\n{cut['sessions']} sessions terminated in {cut['rounds']} rounds")
    assert cut["sessions"] > 20, cut
    assert [k for k, n in applied.items() if n > 1] == []
    assert {m for _port, m in applied} == set(ids)
    assert backed_out == 0
    assert set(states.values()) == {"started"}, states


def test_the_container_works_on_against_the_promoted_primary(rabbit: Backend, pair: Replicated) -> None:
    fleet = Fleet(rabbit, pair)
    first, second = ids_for("before", 100), ids_for("after", 100)
    try:
        with fleet.container() as container:
            pid = container.pid
            fleet.send(first)
            wait_for(lambda: len(fleet.applied()) >= 40, 60, interval=0.2, what="work under way")
            old = pair.primary.port
            took = pair.fail_over()
            fleet.send(second)
            wait_for(lambda: fleet.left() == 0 and len(fleet.applied()) >= len(first) + len(second), 120,
                     interval=0.5, what="every message applied after the failover")
            time.sleep(2)
            assert container.alive() and container.pid == pid
            states = {row["port"]: row["state"] for row in container.rows()}
            output = container.output()
        applied, backed_out = fleet.applied(), fleet.backed_out()
    finally:
        fleet.close()
    print(f"\nfailover from {old} to {pair.primary.port} in {took:.1f}s")
    assert [k for k, n in applied.items() if n > 1] == []
    assert {m for _port, m in applied} == set(first) | set(second)
    assert backed_out == 0
    assert set(states.values()) == {"started"}, (states, output[-3000:])
    # A write that reached the standby (a URL without target_session_attrs): an outage, not counted.
    standby = create_engine(pair.standby.url(pair.database))
    try:
        with pytest.raises(DBAPIError) as refused, standby.begin() as conn:
            conn.execute(fleet.effects.insert().values(port="Work", message_id="on-the-standby"))
    finally:
        standby.dispose()
    assert getattr(refused.value.orig, "sqlstate", None) == "25006"
    assert is_infrastructure(refused.value)
