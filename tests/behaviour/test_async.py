"""Async handlers (README, "Async handlers"): ``async def`` behind the same guarantees.

Every test drives real ``mdb run`` processes on the embedded broker + SQLite and on
RabbitMQ + PostgreSQL (the ``backend`` fixture), with the handlers of
tests/apps/asyncwork.py (a function) and tests/apps/asyncbean.py (a bean with
bean-managed transactions and async setup/teardown).
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from mdbcontainer.testing import headers_of, mdb, wait_for
from tests.conftest import ROOT, Backend, mdb_here, on_embedded, one_line_error


def async_settings(backend: Backend, port: str = "AsyncWork", queues: dict[str, Any] | None = None,
                   **settings: Any) -> tuple[Path, str]:
    work = backend.q("AWORK")
    path = backend.write(ports={port: {"destination": work, **settings}},
                         queues={work: {}, **(queues or {})})
    return path, work


def send(backend: Backend, path: Path, queue: str, bodies: list[dict[str, Any]],
         prefix: str = "m") -> list[str]:
    ids = [f"{prefix}-{i:04d}" for i in range(len(bodies))]
    with backend.producer(path) as producer:
        for message_id, body in zip(ids, bodies, strict=True):
            producer.send(queue, body, message_id=message_id)
    return ids


@pytest.mark.parametrize("transaction", ["container", "none"])
def test_an_async_handler_commits_each_message_once_with_waits_overlapped(
        backend: Backend, transaction: str) -> None:
    path, work = async_settings(backend, transaction=transaction, concurrency=20)
    bodies = [{"n": i, "action": "sleep", "seconds": 0.5} for i in range(40)]
    ids = send(backend, path, work, bodies)
    with backend.container(path) as container:
        started = time.monotonic()
        wait_for(lambda: len(backend.attempts("AsyncWork")) == 40, timeout=60,
                 what="every message to reach the handler")
        elapsed = time.monotonic() - started
        wait_for(lambda: backend.probe(path).count(work) == 0, timeout=30, what="the queue to drain")
        assert container.terminate() == 0
    # 40 handlers waiting 0.5 s each, 20 at a time: about 1 s, never 20 s one by one.
    assert elapsed < 10, f"the waits did not overlap: {elapsed:.1f}s"
    if transaction == "container":
        assert backend.effects("AsyncWork") == Counter({i: 1 for i in ids})
    assert [a for a in backend.attempts("AsyncWork") if a[3] > 0] == [], "no delivery failed"


def test_poison_counts_backs_out_at_the_threshold_and_the_rest_commit_once(backend: Backend) -> None:
    """Counts, Maximum retries (max_retries >= threshold: never stops) and backout, as for def handlers."""
    path, work = async_settings(backend, transaction="container", concurrency=10, max_retries=5,
                                queues={})
    bodies = [{"n": i, "action": "fail" if i == 7 else "ok"} for i in range(30)]
    ids = send(backend, path, work, bodies)
    with backend.container(path) as container:
        dead = backend.q("DLQ")
        wait_for(lambda: backend.probe(path).count(dead) == 1, timeout=60, what="the poison backout")
        wait_for(lambda: backend.probe(path).count(work) == 0, timeout=30, what="the queue to drain")
        state = container.port_state("AsyncWork")
        assert container.terminate() == 0
    assert backend.effects("AsyncWork") == Counter({i: 1 for i in ids if i != "m-0007"})
    (moved,) = backend.probe(path).take_all(dead)
    headers = headers_of(moved)
    assert moved.properties["message_id"] == "m-0007"
    assert headers["x-mdb-redelivery-count"] == 5 and "poison message 7" in headers["x-mdb-exception"]
    assert [a[3] for a in backend.attempts("AsyncWork") if a[1] == "m-0007"] == [0, 1, 2, 3, 4]
    assert state is not None and state["state"] == "started"


# The async pipeline's count and stop; the requeue at the stop is the transport's, the same as for a
# def handler, and tests/behaviour/test_poison.py checks it on both backends.
@on_embedded
def test_maximum_retries_stops_the_async_port_with_the_message_back_on_its_queue(backend: Backend) -> None:
    path, work = async_settings(backend, transaction="container", max_retries=1)
    send(backend, path, work, [{"n": 1, "action": "fail"}])
    with backend.container(path).start(wait=False) as container:
        wait_for(lambda: (container.port_state("AsyncWork") or {}).get("state") == "stopped",
                 timeout=60, what="the port to stop")
        assert "maximum retries (1) exceeded" in container.port_state("AsyncWork")["reason"]
        assert backend.probe(path).count(work) == 1, "the failing message is back on its queue"
        assert container.terminate() == 0
    assert [a[3] for a in backend.attempts("AsyncWork")] == [0, 1]


@pytest.mark.parametrize("port", ["AsyncWork", "AsyncBean"])
def test_sends_are_part_of_the_unit_of_work(backend: Backend, port: str) -> None:
    """ctx.send is a plain call: an outbox row with the work, or nothing when the unit rolls back."""
    work, down = backend.q("AWORK"), backend.q("DOWN")
    settings: dict[str, Any] = {"destination": work, "concurrency": 5, "max_retries": 5}
    if port == "AsyncWork":
        settings["transaction"] = "container"
    path = backend.write(ports={port: settings, "Downstream": {"destination": down}},
                         queues={work: {"backout_threshold": 1}, down: {}},
                         listeners=[f"tests.apps.{port.lower()}", "tests.apps.downstream"])
    bodies = [{"n": i, "action": "send", "to": down} for i in range(10)]
    bodies.append({"n": 99, "action": "send", "to": down, "then": "fail"})
    ids = send(backend, path, work, bodies)
    with backend.container(path) as container:
        wait_for(lambda: len(backend.effects("Downstream")) == 10, timeout=60,
                 what="every send to arrive downstream")
        wait_for(lambda: backend.probe(path).count(backend.q("DLQ")) == 1, timeout=30,
                 what="the failing message's backout")
        time.sleep(0.5)
        assert container.terminate() == 0
    assert backend.effects(port) == Counter({i: 1 for i in ids[:10]})
    assert backend.effects("Downstream") == Counter({f"{i}.out": 1 for i in ids[:10]})


def test_graceful_stop_lets_short_handlers_finish_and_hands_back_the_long_one(backend: Backend) -> None:
    work = backend.q("AWORK")
    path = backend.write(ports={"AsyncWork": {"destination": work, "transaction": "container",
                                              "concurrency": 10}},
                         queues={work: {}}, shutdown_timeout="3s")
    reached, go = backend.tmp / "reached", backend.tmp / "go"
    with backend.producer(path) as producer:
        producer.send(work, {"n": 0, "action": "ok", "pause": [str(reached), str(go)]}, message_id="long")
        for i in range(1, 6):
            producer.send(work, {"n": i, "action": "sleep", "seconds": 1.0}, message_id=f"short-{i}")
    container = backend.container(path).start()
    try:
        wait_for(reached.exists, timeout=30, what="the long handler to start")
        wait_for(lambda: len(backend.attempts("AsyncWork")) == 6, timeout=30, what="all six to start")
        assert container.terminate() == 0, container.output()[-3000:]
    finally:
        container.kill()
    output = container.output()
    assert "cancelled, rolled back and handed back" in output, output[-3000:]
    assert backend.effects("AsyncWork") == Counter({f"short-{i}": 1 for i in range(1, 6)})
    assert backend.probe(path).count(work) == 1, "the cancelled one is back on its queue"
    go.touch()
    with backend.container(path) as again:
        wait_for(lambda: "long" in backend.effects("AsyncWork"), timeout=30, what="the long one again")
        assert again.terminate() == 0
    # Handed back, not counted: its second delivery has redelivery count 0.
    assert [a[3] for a in backend.attempts("AsyncWork") if a[1] == "long"] == [0, 0]


# The loop watchdog's warning is the container's own; the heartbeat side on RabbitMQ is
# test_a_handler_blocking_the_loop_past_two_heartbeats_is_warned_about_not_looped.
@on_embedded
def test_a_handler_that_blocks_the_loop_is_named_in_a_warning(backend: Backend) -> None:
    path, work = async_settings(backend, transaction="none")
    send(backend, path, work, [{"n": 1, "action": "block", "seconds": 1.6}])
    with backend.container(path) as container:
        wait_for(lambda: backend.probe(path).count(work) == 0 and backend.attempts("AsyncWork"),
                 timeout=30, what="the message to be handled")
        wait_for(lambda: "blocked the event loop" in container.output(), timeout=10,
                 what="the warning")
        assert container.terminate() == 0
    line = next(ln for ln in container.output().splitlines() if "blocked the event loop" in ln)
    assert "WARNING" in line and "tests.apps.asyncwork:work" in line, line


# A settings error, refused before any broker or database is reached.
@on_embedded
def test_an_explicit_prefetch_below_concurrency_is_a_settings_error(backend: Backend) -> None:
    path, _ = async_settings(backend, concurrency=20, prefetch=5)
    for command in ("check", "run"):  # check in this process (no Python start-up), run as a process
        result = (mdb_here(command, settings=path, env=backend.env) if command == "check"
                  else mdb(command, "-c", str(path), cwd=ROOT, env=backend.env, timeout=60))
        line = one_line_error(result, 2)
        assert "ports.AsyncWork.prefetch" in line and "concurrency (20)" in line, line


@pytest.mark.rabbitmq
@pytest.mark.postgres
@pytest.mark.parametrize("port", ["AsyncWork", "AsyncBean"])
def test_a_unit_the_database_ended_is_a_failed_delivery_never_acknowledged(rabbit: Backend,
                                                                         port: str) -> None:
    """An error caught inside the transaction: PostgreSQL ends it, and its COMMIT would roll back
    silently. The delivery fails (counted, backed out at the threshold), its row never appears.
    (SQLite keeps its transaction open after a failed statement: nothing ends it there.)"""
    backend = rabbit
    work = backend.q("AWORK")
    settings: dict[str, Any] = {"destination": work, "max_retries": 5}
    if port == "AsyncWork":
        settings["transaction"] = "container"
    path = backend.write(ports={port: settings}, queues={work: {"backout_threshold": 2}})
    send(backend, path, work, [{"n": 1, "action": "swallow"}, {"n": 2, "action": "ok"}])
    with backend.container(path) as container:
        wait_for(lambda: backend.probe(path).count(backend.q("DLQ")) == 1, timeout=60,
                 what="the backout of the message whose transaction was ended")
        assert container.terminate() == 0
    assert backend.effects(port) == Counter({"m-0001": 1})
    assert [a[3] for a in backend.attempts(port) if a[1] == "m-0000"] == [0, 1]
    (moved,) = backend.probe(path).take_all(backend.q("DLQ"))
    assert "TransactionAborted" in headers_of(moved)["x-mdb-exception"]


@pytest.mark.parametrize("port", ["AsyncBatch", "AsyncWork"])
def test_an_async_handler_on_a_batched_port_commits_once_and_a_bad_message_fails_alone(
        backend: Backend, port: str) -> None:
    """A batch handler (AsyncBatch) or a per-message one (AsyncWork) with batch_size 10: the
    batch's rows and dedup rows commit together; a failure rolls the batch back, each message
    runs again alone, and only the bad one counts and is backed out."""
    work = backend.q("ABATCH")
    path = backend.write(ports={port: {"destination": work, "transaction": "container",
                                       "batch_size": 10, "batch_linger": "300ms", "max_retries": 5}},
                         queues={work: {"backout_threshold": 2}})
    bodies = [{"n": i, "action": "fail" if i == 14 else "ok"} for i in range(30)]
    ids = send(backend, path, work, bodies)
    with backend.container(path) as container:
        wait_for(lambda: backend.probe(path).count(backend.q("DLQ")) == 1, timeout=60, what="the backout")
        wait_for(lambda: len(backend.effects(port)) == 29, timeout=60, what="the good messages")
        wait_for(lambda: {k: (container.port_state(port) or {}).get(k) for k in ("handled", "failed")}
                 == {"handled": 29, "failed": 2}, timeout=30, what="29 handled, 2 failed")
        row = container.port_state(port) or {}
        assert container.terminate() == 0
    assert backend.effects(port) == Counter({i: 1 for i in ids if i != "m-0014"})
    assert row["fallbacks"] >= 1 and row["batches"] < 29


# The outage is the handler's own (a refused PostgreSQL connection while a flag file exists, on
# either backend): how the async port holds and retries it is the container's, not the transport's.
@on_embedded
def test_a_database_outage_in_an_async_handler_is_waited_out_uncounted(backend: Backend) -> None:
    """The handler's database refuses it (a real OperationalError) while a flag file exists: the
    delivery is held and retried with backoff, counted as no failure, then handled once."""
    flag = backend.tmp / "down"
    flag.touch()
    path, work = async_settings(backend, transaction="container", concurrency=5)
    send(backend, path, work, [{"n": 1, "action": "outage", "flag": str(flag)}, {"n": 2}])
    with backend.container(path) as container:
        wait_for(lambda: len([a for a in backend.attempts("AsyncWork") if a[1] == "m-0000"]) >= 3,
                 timeout=30, what="the held delivery to be retried")
        flag.unlink()
        wait_for(lambda: len(backend.effects("AsyncWork")) == 2, timeout=30, what="both handled")
        assert container.terminate() == 0
    assert backend.effects("AsyncWork") == Counter({"m-0000": 1, "m-0001": 1})
    assert {a[3] for a in backend.attempts("AsyncWork")} == {0}, "the outage counted nothing"
    assert "database unavailable" in container.output()


# The handler_timeout watchdog reads the port's own tasks; no broker or database decides it.
@on_embedded
def test_handler_timeout_names_the_oldest_async_call_past_it(backend: Backend) -> None:
    """handler_timeout watches the tasks of an async port: the call still awaiting is named."""
    path, work = async_settings(backend, transaction="none", concurrency=5, handler_timeout="1s")
    send(backend, path, work, [{"n": 1, "action": "sleep", "seconds": 4}, {"n": 2}])
    with backend.container(path) as container:
        wait_for(lambda: "handler stuck" in container.output(), timeout=30, what="the stuck warning")
        wait_for(lambda: backend.probe(path).count(work) == 0, timeout=30, what="both handled")
        assert container.terminate() == 0
    line = next(ln for ln in container.output().splitlines() if "handler stuck" in ln)
    assert "port AsyncWork consumer 0" in line and "message m-0000" in line, line


def test_a_message_back_from_its_delay_waits_for_a_transaction_held_across_an_await(
        embedded: Backend) -> None:
    """SQLite, the development default: a task holds the write lock across an await while a
    failed message comes back from its redelivery delay. Its count is written on the loop's
    thread, so it must wait at the write gate (not on SQLite's lock, blocking the loop that
    would let the holder commit), and nothing may hang."""
    work = embedded.q("AWORK")
    path = embedded.write(ports={"AsyncWork": {"destination": work, "transaction": "container",
                                               "concurrency": 3, "max_retries": 10}},
                          queues={work: {"redelivery_delay": "1s"}}, database_timeout="2s")
    with embedded.container(path) as container:
        send(embedded, path, work, [{"n": 1, "fail_first": 1}], prefix="late")
        wait_for(lambda: embedded.attempts("AsyncWork"), timeout=20, what="the first failure")
        send(embedded, path, work, [{"n": 0, "hold": 5}])  # holds the lock as the other comes back
        wait_for(lambda: len(embedded.effects("AsyncWork")) == 2, timeout=25,
                 what=f"both messages handled (a hang?): {container.output()[-3000:]}")
        assert container.terminate() == 0
    assert embedded.effects("AsyncWork") == Counter({"m-0000": 1, "late-0000": 1})
    assert [a[3] for a in embedded.attempts("AsyncWork") if a[1] == "late-0000"] == [0, 1]


@pytest.mark.rabbitmq
@pytest.mark.postgres
def test_a_handler_blocking_the_loop_past_two_heartbeats_is_warned_about_not_looped(
        rabbit: Backend) -> None:
    """heartbeat = 2s and a 6 s blocking call: the connection lives, the message is handled
    once (no redelivery uncounted, round and round), and a WARNING names the handler."""
    work = rabbit.q("ABLOCK")
    path = rabbit.write(ports={"AsyncWork": {"destination": work, "transaction": "none"}},
                        queues={work: {}}, heartbeat="2s")
    send(rabbit, path, work, [{"n": 1, "action": "block", "seconds": 6}])
    with rabbit.container(path) as container:
        wait_for(lambda: rabbit.attempts("AsyncWork"), timeout=20, what="the handler to start")
        time.sleep(12)  # the block, and time for a redelivery, had the connection died
        output = container.output()
        assert container.terminate() == 0
    assert [a[3] for a in rabbit.attempts("AsyncWork")] == [0], output[-3000:]
    assert rabbit.probe(path).count(work) == 0
    assert "blocked the event loop" in output
    assert "broker unavailable" not in output and "the connection is dead" not in output, output[-3000:]
