"""Units of work as a user sees them: CMT, BMT and NotSupported, dedup, sends, table names.

Each test runs ``mdb run`` on the embedded broker + SQLite and on RabbitMQ +
PostgreSQL, and checks what a user would notice: committed rows, what reached
a queue, what the container logged and what landed in the backout queue.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, func, inspect, select, text
from sqlalchemy import exc as sa_exc

from mdbcontainer.state.database import is_infrastructure
from mdbcontainer.state.store import Tables
from mdbcontainer.testing import ContainerProcess, headers_of, mdb, wait_for
from mdbcontainer.wire.connection import Broker
from tests.conftest import ROOT, Backend, on_embedded, one_line_error

pytestmark = pytest.mark.slow

# The database's own text for a unique-key violation, as the driver reports it.
DUPLICATE_KEY = {
    "rabbitmq": "duplicate key value violates unique constraint",
    "embedded": "UNIQUE constraint failed",
}


def send_all(backend: Backend, settings: Path, queue: str, bodies: list[tuple[str, dict]]) -> None:
    with backend.producer(settings) as producer:
        for message_id, body in bodies:
            producer.send(queue, body, message_id=message_id)


def counts_of(backend: Backend, message_id: str) -> list[int]:
    """The redelivery count the handler saw on each attempt at ``message_id``."""
    return [a[3] for a in backend.attempts() if a[1] == message_id]


def outbox_backlog(backend: Backend) -> int:
    table = Tables.build(schema=backend.schema).outbox
    with backend.engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(table)).scalar() or 0)


def dead_letters(backend: Backend, settings: Path) -> dict[str, Any]:
    return {str(m.properties.get("message_id")): m
            for m in backend.probe(settings).take_all(backend.q("DLQ"))}


def test_a_commit_rejected_by_a_constraint_is_a_failed_delivery_with_the_database_text(
    backend: Backend,
) -> None:
    statement, deferred = backend.q("STATEMENT"), backend.q("DEFERRED")
    settings = backend.write(
        ports={"Work": {"destination": statement, "max_retries": 3, "prefetch": 1},
               "Deferred": {"destination": deferred, "max_retries": 3, "prefetch": 1}},
        queues={statement: {"backout_threshold": 3}, deferred: {"backout_threshold": 3}},
        listeners=["tests.apps.work", "tests.apps.deferred"],
    )
    # Work inserts the key in the handler; Deferred adds an ORM object whose INSERT
    # is flushed only by the container's commit, after the handler returned.
    send_all(backend, settings, statement, [("w-1", {"n": 1, "action": "constraint"}),
                                            ("w-2", {"n": 2, "action": "constraint"})])
    send_all(backend, settings, deferred, [("d-1", {"key": "k"}), ("d-2", {"key": "k"})])
    with backend.container(settings) as container:
        wait_for(lambda: backend.probe(settings).count(backend.q("DLQ")) == 2, what="two backouts")
        assert container.port_state("Work")["state"] == "started"
        assert container.port_state("Deferred")["state"] == "started"
        log = container.output()
    expected = DUPLICATE_KEY[backend.kind]
    for message_id in ("w-2", "d-2"):
        failures = [line for line in log.splitlines() if f"delivery failed: message {message_id}," in line]
        assert len(failures) == 3 and all(expected in line for line in failures), log[-3000:]
    assert counts_of(backend, "w-2") == [0, 1, 2], "redelivered until the threshold"
    assert counts_of(backend, "d-2") == [0, 1, 2]
    assert backend.effects() == {"w-1": 1}, "the failed commits left nothing"
    dead = dead_letters(backend, settings)
    assert sorted(dead) == ["d-2", "w-2"]
    for message in dead.values():
        assert headers_of(message)["x-mdb-redelivery-count"] == 3
        assert expected in headers_of(message)["x-mdb-exception"]
        assert "IntegrityError" in headers_of(message)["x-mdb-exception"]


def test_set_rollback_only_discards_the_work_and_the_sends_and_redelivers(backend: Backend) -> None:
    queue, out = backend.q("IN"), backend.q("OUT")
    settings = backend.write(ports={"Work": {"destination": queue, "max_retries": 2}},
                             queues={queue: {"backout_threshold": 2}, out: {}})
    send_all(backend, settings, queue, [
        ("undone", {"n": 1, "action": "send", "to": out, "then": "rollback"}),
        ("done", {"n": 2, "action": "send", "to": out}),
    ])
    probe = backend.probe(settings)  # the handler's send declares ``out``
    with backend.container(settings):
        wait_for(lambda: backend.probe(settings).count(backend.q("DLQ")) == 1, what="backout")
        wait_for(lambda: probe.exists(out) and probe.count(out) == 1, what="the committed send")
        # The committed send's row leaves once its publish is confirmed (a moment after the
        # message arrives); a rolled-back send's row, had one been written, never would.
        wait_for(lambda: outbox_backlog(backend) == 0, timeout=10,
                 what="no outbox row left: the rolled-back send wrote none")
    assert counts_of(backend, "undone") == [0, 1]
    assert backend.effects() == {"done": 1}
    assert [m.properties["message_id"] for m in backend.probe(settings).take_all(out)] == ["done.out"]
    assert outbox_backlog(backend) == 0, "the rolled-back send left no outbox row"
    undone = dead_letters(backend, settings)["undone"]
    assert "set_rollback_only" in headers_of(undone)["x-mdb-exception"]


def test_an_exception_rolls_back_the_bean_managed_transaction(backend: Backend) -> None:
    queue, out = backend.q("IN"), backend.q("OUT")
    settings = backend.write(ports={"Bean": {"destination": queue, "max_retries": 2}},
                             queues={queue: {"backout_threshold": 2}, out: {}})
    send_all(backend, settings, queue, [
        ("undone", {"n": 1, "action": "send", "to": out, "then": "fail"}),
        ("done", {"n": 2, "action": "send", "to": out}),
    ])
    probe = backend.probe(settings)  # the handler's send declares ``out``
    with backend.container(settings):
        wait_for(lambda: backend.probe(settings).count(backend.q("DLQ")) == 1, what="backout")
        wait_for(lambda: probe.exists(out) and probe.count(out) == 1, what="the committed send")
        wait_for(lambda: outbox_backlog(backend) == 0, timeout=10,
                 what="no outbox row left: the rolled-back send wrote none")
    # The handler ran again on the redelivery: its dedup mark was rolled back too.
    assert counts_of(backend, "undone") == [0, 1]
    assert backend.effects("Bean") == {"done": 1}
    assert [m.properties["message_id"] for m in backend.probe(settings).take_all(out)] == ["done.out"]
    assert outbox_backlog(backend) == 0
    undone = dead_letters(backend, settings)["undone"]
    assert "RuntimeError: failed after its work 1" in headers_of(undone)["x-mdb-exception"]


# NotSupported touches no database: the session's absence and the send at once are the unit's
# rules; the send's publish crosses both transports in the tests above.
@on_embedded
def test_not_supported_runs_without_a_session_and_sends_at_once(backend: Backend) -> None:
    plain, needs_session, out = backend.q("PLAIN"), backend.q("SESSION"), backend.q("OUT")
    settings = backend.write(
        ports={"Work": {"destination": plain, "transaction_attribute": "NotSupported"},
               "Downstream": {"destination": needs_session, "max_retries": 1,
                              "transaction_attribute": "NotSupported"}},
        queues={needs_session: {"backout_threshold": 1}, out: {}},
    )
    # Work's handler does without a session; Downstream's asks ctx.session for one.
    send_all(backend, settings, plain, [("plain", {"n": 1, "action": "send", "to": out})])
    send_all(backend, settings, needs_session, [("session", {"n": 2})])
    probe = backend.probe(settings)  # the handler's send declares ``out``
    with backend.container(settings):
        wait_for(lambda: probe.exists(out) and probe.count(out) == 1, what="the send")
        wait_for(lambda: backend.probe(settings).count(backend.q("DLQ")) == 1, what="backout")
    assert counts_of(backend, "plain") == [0], "handled once, not redelivered"
    assert backend.effects() == {}, "no transaction, no row"
    assert [m.properties["message_id"] for m in backend.probe(settings).take_all(out)] == ["plain.out"]
    failed = dead_letters(backend, settings)["session"]
    assert "TransactionError: port 'Downstream': ctx.session exists only with" in (
        headers_of(failed)["x-mdb-exception"])


@pytest.mark.parametrize("port", ["Work", "Bean"])
def test_two_consumers_given_the_same_message_id_at_once_apply_it_once(backend: Backend,
                                                                       port: str) -> None:
    queue = backend.q("IN")
    settings = backend.write(ports={port: {"destination": queue, "concurrency": 4, "prefetch": 1}})
    ids = [f"twin-{i}" for i in range(10)]
    with backend.container(settings) as container:
        # Consumers are idle when the twins arrive, so the two copies of an id go to
        # two consumers at once; the second waits on the first's dedup row.
        send_all(backend, settings, queue, [(i, {"n": n, "action": "sleep", "seconds": 0.2})
                                            for n, i in enumerate(ids) for _ in range(2)])
        wait_for(lambda: set(backend.effects(port)) == set(ids), what="every id applied")
        wait_for(lambda: (container.port_state(port) or {}).get("duplicate_skipped") == len(ids),
                 what="the second copies skipped")
        assert backend.probe(settings).count(queue) == 0
    assert set(backend.effects(port).values()) == {1}
    if backend.kind == "rabbitmq":
        # PostgreSQL: the dedup row is claimed first, so the second copy waits on it
        # and never reaches the handler. SQLite claims last (its one write lock would
        # otherwise serialize whole handlers): both copies may run, one commits.
        handled = sorted(a[1] for a in backend.attempts(port))
        assert handled == sorted(ids), "the handler ran once per id"


def publish_without_id(backend: Backend, settings: Path, queue: str, body: dict[str, Any]) -> None:
    """Publish as a producer outside this package might: no AMQP message_id."""
    conn = Broker(backend.settings(settings)).connect()
    try:
        conn.Producer().publish(body, exchange="", routing_key=queue, serializer="json",
                                delivery_mode=2)
    finally:
        conn.close()


def test_a_message_without_id_is_backed_out_or_identified_by_its_body(backend: Backend) -> None:
    strict, hashed = backend.q("STRICT"), backend.q("HASHED")
    settings = backend.write(ports={"Work": {"destination": strict},
                                    "Downstream": {"destination": hashed, "missing_id": "body-hash"}})
    with backend.container(settings):
        publish_without_id(backend, settings, strict, {"n": 1})
        for _ in range(2):
            publish_without_id(backend, settings, hashed, {"n": 2})
        wait_for(lambda: backend.probe(settings).count(backend.q("DLQ")) == 1, what="backout")
        wait_for(lambda: backend.effects("Downstream"), what="the hashed message applied")
        wait_for(lambda: backend.probe(settings).count(hashed) == 0, what="the copy skipped")
    [dead] = backend.probe(settings).take_all(backend.q("DLQ"))
    assert not dead.properties.get("message_id")
    assert headers_of(dead)["x-mdb-backout-reason"] == "missing-message-id"
    assert headers_of(dead)["x-mdb-port"] == "Work"
    assert backend.attempts("Work") == [], "the handler never saw it"
    [(message_id, applied)] = backend.effects("Downstream").items()
    assert message_id.startswith("sha256:") and applied == 1
    assert len(backend.attempts("Downstream")) == 1


def test_the_container_tables_honour_table_prefix_and_db_schema(backend: Backend) -> None:
    queue, down = backend.q("IN"), backend.q("DOWN")
    own_schema = f"{backend.schema}_mdb" if backend.schema else None
    extra = {"db_schema": own_schema} if own_schema else {}
    settings = backend.write(ports={"Work": {"destination": queue}, "Downstream": {"destination": down}},
                             table_prefix="acme_", **extra)
    send_all(backend, settings, queue, [("p-1", {"n": 1, "action": "send", "to": down})])
    try:
        with backend.container(settings):
            wait_for(lambda: backend.effects("Downstream"), what="the send consumed")
        tables = set(inspect(backend.engine).get_table_names(schema=own_schema))
        assert {"acme_dedup", "acme_delivery", "acme_outbox", "acme_port", "acme_container",
                "acme_lease"} <= tables
        assert not [t for t in tables if t.startswith("mdb_")]
        if own_schema:
            business = set(inspect(backend.engine).get_table_names(schema=backend.schema))
            assert business == {"effects", "unique_keys"}, "nothing of the container's here"
        dedup = Tables.build("acme_", own_schema).dedup
        with backend.engine.connect() as conn:
            rows = {(r.port, r.message_id) for r in conn.execute(select(dedup))}
        assert rows == {("Work", "p-1"), ("Downstream", "p-1.out")}
    finally:
        if own_schema:
            with backend.engine.begin() as conn:
                conn.execute(text(f'DROP SCHEMA IF EXISTS "{own_schema}" CASCADE'))


@pytest.mark.postgres
def test_postgres_errors_are_classified_by_sqlstate() -> None:
    from tests.conftest import POSTGRES_URL, require

    require(5432, "PostgreSQL")
    engine = create_engine(POSTGRES_URL)
    try:
        with engine.connect() as conn:
            conn.execute(text("SET statement_timeout = '50ms'"))
            with pytest.raises(sa_exc.OperationalError) as timeout:
                conn.execute(text("SELECT pg_sleep(1)"))
        assert not is_infrastructure(timeout.value), "a statement timeout is the message's failure"
        with engine.connect() as conn, pytest.raises(sa_exc.DBAPIError) as deadlock:
            conn.execute(text("DO $$ BEGIN RAISE EXCEPTION USING ERRCODE = '40P01'; END $$"))
        assert is_infrastructure(deadlock.value), "a deadlock passes on retry"
    finally:
        engine.dispose()


def test_an_outbox_send_to_a_topic_nobody_subscribes_leaves_and_is_dropped(backend: Backend) -> None:
    """A publish to a topic is confirmed, not mandatory (README): with no subscription the
    message is dropped. The outbox must not keep it because the topic was never declared."""
    queue, topic = backend.q("Q"), backend.q("events")
    settings = backend.write(ports={"Work": {"destination": queue}}, queues={queue: {}},
                             topics={topic: {}})
    with backend.container(settings) as container:
        with backend.producer(settings) as producer:
            producer.send(queue, {"n": 1, "action": "send", "to": topic}, message_id="m1")
        wait_for(lambda: backend.effects() == {"m1": 1}, what="the handler's work")
        wait_for(lambda: outbox_backlog(backend) == 0, timeout=10, what="the outbox row to leave")
        output = container.output()
    assert "deferred" not in output and "not published" not in output, output


def test_a_send_a_crash_left_in_the_outbox_leaves_once_it_is_outbox_relay_grace_old(
        backend: Backend) -> None:
    """Killed between the commit and the publish: the next container relays the row once it is
    ``outbox_relay_grace`` old (here 1 s), looking that often; at the default 5 s the send
    would wait at least 5 s for the relay's first look."""
    queue, down = backend.q("Q"), backend.q("DOWN")
    settings = backend.write(ports={"Work": {"destination": queue, "transaction": "container"},
                                    "Downstream": {"destination": down}},
                             queues={queue: {}, down: {}}, outbox_relay_grace="1s")
    crashing = ContainerProcess(settings, cwd=ROOT, env={
        **backend.env, "MDB_CRASH_AT": "after-commit", "MDB_CRASH_ONCE_FILE": str(backend.tmp / "crashed")})
    with crashing:
        with backend.producer(settings) as producer:
            producer.send(queue, {"n": 1, "action": "send", "to": down}, message_id="m1")
        assert crashing.wait_exit(60) == -9, "killed between the commit and the outbox publish"
    assert backend.effects() == {"m1": 1} and outbox_backlog(backend) == 1, "the send was left behind"
    with backend.container(settings):
        started = time.monotonic()
        wait_for(lambda: backend.effects("Downstream") == {"m1.out": 1}, timeout=20,
                 what="the relayed send downstream")
        took = time.monotonic() - started
    assert took < 4.5, f"the relay took {took:.1f}s to send a row older than its 1 s grace"
    assert outbox_backlog(backend) == 0
    assert backend.effects() == {"m1": 1, "m1.out": 1}, "the work once, its send once"


def test_a_handler_sql_error_is_a_failed_delivery_not_a_database_outage(backend: Backend) -> None:
    """The handler raised, so the delivery failed and counts. SQLite reports a
    missing table as OperationalError, the class of lost connections; it must not be
    waited out as an outage forever, never counted and never backed out."""
    queue = backend.q("Q")
    settings = backend.write(ports={"Work": {"destination": queue, "max_retries": 5}},
                             queues={queue: {"backout_threshold": 2}})
    with backend.container(settings) as container:
        with backend.producer(settings) as producer:
            producer.send(queue, {"action": "badsql"}, message_id="bad")
        wait_for(lambda: backend.probe(settings).count(backend.q("DLQ")) == 1, timeout=15,
                 what="the message backed out after two failed deliveries")
        output = container.output()
    assert "database unavailable" not in output, output
    assert [a[3] for a in backend.attempts()] == [0, 1]
    dead = backend.probe(settings).take_all(backend.q("DLQ"))
    assert "no_such_table" in dict(dead[0].headers)["x-mdb-exception"]


@pytest.mark.parametrize(("port", "extra"), [
    ("Upsert", {}),  # container-managed, one message a unit of work
    ("UpsertBean", {}),  # bean-managed, one message
    ("Upsert", {"batch_size": 10, "batch_linger": "300ms"}),  # container-managed batch
    ("UpsertBatch", {"batch_size": 10, "batch_linger": "300ms"}),  # container-managed batch handler
    ("UpsertBatch", {"batch_size": 10, "batch_linger": "300ms", "transaction": "bean"}),
], ids=["container", "bean", "container-batch", "batch-handler", "bean-batch"])
def test_a_database_error_the_handler_swallowed_is_never_acknowledged_as_handled(
    backend: Backend, port: str, extra: dict[str, Any],
) -> None:
    """PostgreSQL aborts the transaction at the error the handler caught; COMMIT then rolls
    back without raising. Such a unit did not commit: a failed delivery (a batch runs each
    message alone), never acknowledged with its rows and dedup marks gone."""
    queue = backend.q("UPSERT")
    settings = backend.write(ports={port: {"destination": queue, "max_retries": 10, **extra}},
                             queues={queue: {"backout_threshold": 2}})
    ids = [f"u-{i}" for i in range(7)]
    # Each inserts a key of its own, but u-6 inserts u-0's key again: "already there".
    send_all(backend, settings, queue, [(f"u-{i}", {"n": i, "key": f"k-{i % 6}"}) for i in range(7)])
    with backend.container(settings) as container:
        wait_for(lambda: backend.probe(settings).count(queue) == 0
                 and sum((container.port_state(port) or {}).get(k, 0) for k in ("handled", "backed_out"))
                 == 7, timeout=30, what="every message handled or backed out")
        row = container.port_state(port) or {}
        log = container.output()
    committed = backend.effects(port)
    dead = dead_letters(backend, settings)
    assert set(committed) | set(dead) == set(ids), f"lost: committed {committed}, backed out {list(dead)}"
    assert not set(committed) & set(dead) and set(committed.values()) == {1}
    assert row["handled"] == len(committed), "acknowledged as handled only with its work committed"
    if backend.kind == "rabbitmq":  # the aborted unit failed: counted, then backed out
        assert len(dead) == 1, list(dead)
        exception = headers_of(next(iter(dead.values())))["x-mdb-exception"]
        assert "TransactionAborted" in exception and "savepoint" in exception, exception
        assert row["failed"] == 2 and row["state"] == "started", row
    else:  # SQLite fails the statement alone: the key was there, the rest commits
        assert dead == {} and len(committed) == 7, (list(dead), committed)
    assert "Traceback" not in log.split("delivery failed")[0]


def test_on_sqlite_database_timeout_bounds_the_wait_for_the_write_lock(tmp_path: Path) -> None:
    """``database_timeout`` is SQLite's busy timeout: with the write lock held elsewhere,
    ``mdb port stop`` gives up within it, in one line, instead of after a fixed 30 s."""
    backend = Backend("embedded", tmp_path)
    try:
        settings = backend.write(ports={"Work": {"destination": backend.q("Q")}},
                                 database_timeout="2s")
        assert mdb("port", "start", "Work", settings=settings, env=backend.env, cwd=ROOT).returncode == 0
        holder = sqlite3.connect(tmp_path / "container.db", isolation_level=None)
        try:
            holder.execute("BEGIN IMMEDIATE")  # another writer holds the one write lock
            began = time.monotonic()
            result = mdb("port", "stop", "Work", settings=settings, env=backend.env, cwd=ROOT)
            took = time.monotonic() - began
        finally:
            holder.close()
    finally:
        backend.close()
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert "locked" in one_line_error(result)
    assert took < 20, f"waited {took:.1f}s for the lock, not database_timeout (2s)"
