"""Batched ports (README: Batches), as a user sees them: rows committed once, what was
acknowledged, what the failing message alone counted, and the batch figures.

Each test runs ``mdb run`` on the embedded broker + SQLite and on RabbitMQ +
PostgreSQL. The handlers are tests/apps/batched.py (batch handlers) and
tests/apps/work.py (a per-message handler on a batched port).
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from mdbcontainer.testing import ContainerProcess, mdb, wait_for
from tests.conftest import ROOT, Backend, mdb_here, on_embedded

pytestmark = pytest.mark.slow

def send_all(backend: Backend, settings: Path, queue: str, bodies: list[tuple[str, dict[str, Any]]]) -> None:
    with backend.producer(settings) as producer:
        for message_id, body in bodies:
            producer.send(queue, body, message_id=message_id)


def calls(backend: Backend, port: str) -> list[int]:
    """The length of each list a batch handler of ``port`` was called with."""
    path = backend.tmp / "batches.log"
    if not path.exists():
        return []
    return [int(size) for p, size in (line.split("\t") for line in path.read_text().splitlines())
            if p == port]


def attempts_of(backend: Backend, port: str) -> Counter[str]:
    return Counter(a[1] for a in backend.attempts(port))


def container(backend: Backend, settings: Path) -> ContainerProcess:
    env = {**backend.env, "MDB_TEST_BATCHES": str(backend.tmp / "batches.log")}
    return ContainerProcess(settings, env=env, cwd=ROOT)


def dead_letters(backend: Backend, settings: Path) -> dict[str, Any]:
    return {str(m.properties.get("message_id")): m
            for m in backend.probe(settings).take_all(backend.q("DLQ"))}


def headers_of(message: Any) -> dict[str, Any]:
    return dict(message.headers or message.properties.get("application_headers") or {})


def test_a_batch_handler_commits_each_message_once_and_skips_duplicates(backend: Backend) -> None:
    queue = backend.q("BATCH")
    settings = backend.write(ports={"BatchWork": {"destination": queue, "batch_size": 20,
                                                  "batch_linger": "200ms"}})
    ids = [f"b-{i:02d}" for i in range(40)]
    # b-03 twice within one batch, b-05 again after its batch committed.
    bodies = [(i, {"n": n}) for n, i in enumerate(ids)]
    bodies.insert(4, ("b-03", {"n": 3}))
    bodies.append(("b-05", {"n": 5}))
    send_all(backend, settings, queue, bodies)
    with container(backend, settings) as c:
        wait_for(lambda: backend.probe(settings).count(queue) == 0
                 and sum(backend.effects("BatchWork").values()) == 40, what="the batches to commit")
        wait_for(lambda: (c.port_state("BatchWork") or {}).get("duplicate_skipped") == 2,
                 what="two duplicates skipped")
        row = c.port_state("BatchWork") or {}
        shown = subprocess.run([sys.executable, "-m", "mdbcontainer", "ports", "-c", str(settings)],
                               capture_output=True, text=True, cwd=ROOT, timeout=60,
                               env={**backend.env, "COLUMNS": "220"})
    assert backend.effects("BatchWork") == Counter({i: 1 for i in ids}), "each message's work once"
    sizes = calls(backend, "BatchWork")
    assert sum(sizes) == 40 and max(sizes) == 20, f"handler called with lists: {sizes}"
    assert row["handled"] == 40 and row["batches"] >= 2
    assert row["fallbacks"] == 0
    mean = row["batched"] / row["batches"]
    assert f"{row['batches']} x {mean:.1f}/20" in shown.stdout, shown.stdout
    assert "fallbacks" in shown.stdout.splitlines()[0], shown.stdout


def test_a_failing_message_rolls_the_batch_back_and_only_it_counts(backend: Backend) -> None:
    queue = backend.q("FALLBACK")
    settings = backend.write(
        ports={"Work": {"destination": queue, "batch_size": 10, "batch_linger": "300ms",
                        "max_retries": 5}},
        queues={queue: {"backout_threshold": 2}})
    bodies: list[tuple[str, dict[str, Any]]] = [(f"w-{i}", {"n": i}) for i in range(10)]
    bodies[4] = ("w-4", {"n": 4, "action": "fail"})
    send_all(backend, settings, queue, bodies)
    with container(backend, settings) as c:
        wait_for(lambda: backend.probe(settings).count(backend.q("DLQ")) == 1, what="a backout")
        wait_for(lambda: len(backend.effects("Work")) == 9, what="the good messages")
        # The figures come with the container's heartbeat: wait for the one after the backout.
        wait_for(lambda: {k: (c.port_state("Work") or {}).get(k) for k in ("handled", "failed")}
                 == {"handled": 9, "failed": 2}, what="nine handled, two failed")
        row = c.port_state("Work") or {}
        assert row["state"] == "started", "one poison message does not stop the port"
    good = [f"w-{i}" for i in range(10) if i != 4]
    assert backend.effects("Work") == Counter({i: 1 for i in good}), "good work committed once"
    # The messages before the poison one in its batch ran in the rolled-back batch and once
    # alone (those after it never reached the handler in the batch); the poison message ran
    # in the batch, then alone twice (backout_threshold 2), the batch attempt counting nothing.
    # The broker decides how the ten arrive, so the batch may begin after w-0: the messages
    # that ran twice are the ones just before w-4.
    assert [a[3] for a in backend.attempts("Work") if a[1] == "w-4"] == [0, 0, 1]
    ran = attempts_of(backend, "Work")
    before = [ran[f"w-{i}"] for i in range(4)]
    assert before == sorted(before) and set(before) <= {1, 2}, before
    assert [ran[f"w-{i}"] for i in range(5, 10)] == [1, 1, 1, 1, 1]
    dead = dead_letters(backend, settings)
    assert list(dead) == ["w-4"]
    assert headers_of(dead["w-4"])["x-mdb-redelivery-count"] == 2
    assert row["failed"] == 2 and row["handled"] == 9 and row["fallbacks"] >= 1


def test_without_a_transaction_a_failing_message_fails_alone(backend: Backend) -> None:
    queue = backend.q("NONE")
    settings = backend.write(
        ports={"Work": {"destination": queue, "batch_size": 10, "batch_linger": "300ms",
                        "transaction": "none", "max_retries": 5}},
        queues={queue: {"backout_threshold": 1}})
    bodies: list[tuple[str, dict[str, Any]]] = [(f"n-{i}", {"n": i}) for i in range(10)]
    bodies[6] = ("n-6", {"n": 6, "action": "fail"})
    send_all(backend, settings, queue, bodies)
    with container(backend, settings) as c:
        wait_for(lambda: backend.probe(settings).count(backend.q("DLQ")) == 1, what="a backout")
        wait_for(lambda: (c.port_state("Work") or {}).get("handled") == 9, what="nine handled")
        assert backend.probe(settings).count(queue) == 0
        row = c.port_state("Work") or {}
    assert all(n == 1 for n in attempts_of(backend, "Work").values()), "no message ran twice"
    assert row["fallbacks"] == 0 and row["failed"] == 1


def test_a_bean_managed_batch_handler_covers_the_batch_in_one_transaction(backend: Backend) -> None:
    queue = backend.q("BEAN")
    settings = backend.write(ports={"BatchBean": {"destination": queue, "batch_size": 25,
                                                  "batch_linger": "300ms"}})
    bodies = [(f"e-{i:02d}", {"n": i}) for i in range(50)]
    send_all(backend, settings, queue, [*bodies, ("e-07", {"n": 7})])
    with container(backend, settings) as c:
        wait_for(lambda: (c.port_state("BatchBean") or {}).get("delivered") == 51, what="all delivered")
        assert backend.probe(settings).count(queue) == 0
    assert backend.effects("BatchBean") == Counter({i: 1 for i, _ in bodies})
    assert max(calls(backend, "BatchBean")) == 25


# Validation of the bodies against the handler's model happens before any unit of work; the
# backout's publish is the one test_a_failing_message_rolls_the_batch_back... checks on both.
@on_embedded
def test_a_typed_batch_handler_gets_models_and_an_invalid_body_is_backed_out_alone(
    backend: Backend,
) -> None:
    queue = backend.q("TYPED")
    settings = backend.write(ports={"BatchTyped": {"destination": queue, "batch_size": 10,
                                                   "batch_linger": "300ms"}})
    bodies: list[tuple[str, dict[str, Any]]] = [(f"t-{i}", {"n": i}) for i in range(8)]
    bodies[2] = ("t-2", {"n": "not a number"})
    send_all(backend, settings, queue, bodies)
    with container(backend, settings):
        wait_for(lambda: len(backend.effects("BatchTyped")) == 7, what="seven typed items")
        wait_for(lambda: list(dead_letters(backend, settings)) == ["t-2"], what="t-2 backed out")
    assert calls(backend, "BatchTyped") == [7], "one call with the seven valid items"


def test_graceful_stop_hands_back_the_batch_being_gathered_uncounted(backend: Backend) -> None:
    queue = backend.q("LINGER")
    settings = backend.write(ports={"Work": {"destination": queue, "batch_size": 100,
                                             "batch_linger": "30s", "max_retries": 5}})
    send_all(backend, settings, queue, [(f"g-{i}", {"n": i}) for i in range(5)])
    with container(backend, settings) as c:
        wait_for(lambda: (c.port_state("Work") or {}).get("state") == "started", what="started")
        wait_for(lambda: backend.probe(settings).count(queue) == 0, what="the five prefetched")
        assert c.terminate(timeout=20) == 0
    assert backend.effects("Work") == Counter(), "a lingering batch never ran"
    assert backend.probe(settings).count(queue) == 5, "handed back, nothing lost"
    short = backend.write(name="short.toml", ports={"Work": {"destination": queue, "batch_size": 100,
                                                             "batch_linger": "50ms"}})
    with container(backend, short):
        wait_for(lambda: len(backend.effects("Work")) == 5, what="the five handled")
    assert {a[3] for a in backend.attempts("Work")} == {0}, "the hand-back counted no failure"


@pytest.mark.parametrize(("port", "extra", "culprit"), [
    ("Work", {"batch_size": 50, "prefetch": 20}, "ports.Work.prefetch"),
    ("Work", {"batch_size": 10, "transaction": "none", "acknowledge": "client"},
     "ports.Work.acknowledge"),
    ("Bean", {"batch_size": 10}, "ports.Bean.batch_size"),
])
def test_batch_settings_that_cannot_work_are_refused_in_one_line(
    tmp_path: Path, port: str, extra: dict[str, Any], culprit: str,
) -> None:
    backend = Backend("embedded", tmp_path)
    try:
        settings = backend.write(ports={port: {"destination": "q", **extra}},
                                 listeners=[f"tests.apps.{port.lower()}"])
        # In this process (no Python start-up per case): the one line of a settings error.
        result = mdb_here("check", settings=settings, env=backend.env)
    finally:
        backend.close()
    assert result.returncode == 2, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and culprit in lines[0], result.stderr
    assert "Traceback" not in result.stderr


# The figures are the port's own counters served over HTTP; no broker or database decides them.
@on_embedded
def test_the_batch_figures_reach_metrics(backend: Backend) -> None:
    queue = backend.q("METRICS")
    settings = backend.write(ports={"BatchWork": {"destination": queue, "batch_size": 10,
                                                  "batch_linger": "200ms", "max_retries": 5}},
                             queues={queue: {"backout_threshold": 1}},
                             metrics_port=_free_port(), metrics_host="127.0.0.1")
    send_all(backend, settings, queue, [(f"m-{i}", {"n": i}) for i in range(9)]
             + [("m-9", {"n": 9, "action": "rollback"})])
    with container(backend, settings):
        wait_for(lambda: len(backend.effects("BatchWork")) == 9, what="nine committed")
        wait_for(lambda: dead_letters(backend, settings), what="the rolled-back message backed out")
        text = _metrics(backend, settings)
    assert 'mdb_batch_size_count{port="BatchWork"}' in text
    assert 'mdb_batch_fallbacks_total{port="BatchWork"} 1.0' in text


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _metrics(backend: Backend, settings: Path) -> str:
    import urllib.request

    port = backend.settings(settings).container.metrics_port
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return str(response.read().decode())



def test_publish_many_confirms_together_and_names_the_one_message_not_routed(
    backend: Backend,
) -> None:
    from mdbcontainer.wire.connection import Broker
    from mdbcontainer.wire.publisher import Publish, Publisher

    queue = backend.q("MANY")
    settings = backend.write(ports={"Work": {"destination": queue}})
    publisher = Publisher(Broker(backend.settings(settings)))
    try:
        exchange, routing_key, mandatory = publisher.route(queue)
        items = [Publish(exchange, routing_key, b'{"n": 1}', {"message_id": f"p-{i}"}, mandatory)
                 for i in range(300)]
        items.insert(120, Publish("", backend.q("NOWHERE"), b"{}", {"message_id": "lost"}, True))
        errors = publisher.publish_many(items)
    finally:
        publisher.close()
    failed = [(i, type(e).__name__) for i, e in enumerate(errors) if e is not None]
    assert failed == [(120, "Unroutable")], "only the unroutable message is reported"
    wait_for(lambda: backend.probe(settings).count(queue) == 300, what="the 300 routed messages")


# The outage is the handler's own (a refused PostgreSQL connection while a flag file exists, on
# either backend): how the batch holds and retries it is the container's, not the transport's.
@on_embedded
def test_without_a_transaction_a_handler_database_outage_is_waited_out_uncounted(
    backend: Backend,
) -> None:
    """As on the per-message path: the handler's own OperationalError holds its message, counts
    nothing, and the rest of the batch is applied once."""
    queue = backend.q("NONE-OUTAGE")
    settings = backend.write(
        ports={"Work": {"destination": queue, "batch_size": 5, "batch_linger": "300ms",
                        "transaction": "none", "max_retries": 0}},
        queues={queue: {"backout_threshold": 1}})
    flag = backend.tmp / "database-down"
    flag.touch()
    bodies: list[tuple[str, dict[str, Any]]] = [(f"o-{i}", {"n": i}) for i in range(5)]
    bodies[2] = ("o-2", {"n": 2, "action": "outage", "flag": str(flag)})
    send_all(backend, settings, queue, bodies)
    with container(backend, settings) as c:
        wait_for(lambda: attempts_of(backend, "Work")["o-2"] >= 3, what="the outage held and retried")
        row = c.port_state("Work") or {}
        assert row.get("state") == "started" and row.get("failed") == 0, row
        flag.unlink()  # the handler's database is back
        wait_for(lambda: (c.port_state("Work") or {}).get("handled") == 5, timeout=30,
                 what="all five handled")
        row = c.port_state("Work") or {}
    assert (row["failed"], row["backed_out"], row["consecutive_failures"]) == (0, 0, 0), row
    assert backend.probe(settings).count(backend.q("DLQ")) == 0
    ran = attempts_of(backend, "Work")
    assert all(ran[f"o-{i}"] == 1 for i in (0, 1, 3, 4)), f"the others ran once: {ran}"
    assert {a[3] for a in backend.attempts("Work")} == {0}, "no redelivery counted"


@pytest.mark.parametrize("acknowledge", ["client", "dups_ok"])
def test_a_batch_handler_of_one_acknowledges_as_its_port_says(backend: Backend,
                                                              acknowledge: str) -> None:
    """``batch_size = 1`` with acknowledge client or dups_ok: the batch handler gets a list of
    one and acknowledges by the port's mode (``ctx.acknowledge()`` on client), run after run."""
    queue = backend.q("ACK")
    settings = backend.write(ports={"BatchWork": {"destination": queue, "transaction": "none",
                                                  "acknowledge": acknowledge}})
    action = "ack" if acknowledge == "client" else "ok"
    checked = mdb("check", settings=settings, env=backend.env, cwd=ROOT)
    assert checked.returncode == 0, checked.stderr
    for run in range(2):  # a second start works as well as the first
        send_all(backend, settings, queue, [(f"a{run}-{i}", {"n": i, "action": action}) for i in range(3)])
        with container(backend, settings) as c:
            wait_for(lambda: (c.port_state("BatchWork") or {}).get("handled") == 3,
                     what="three handled")
            row = c.port_state("BatchWork") or {}
            assert row["state"] == "started" and row["failed"] == 0, row
            time.sleep(1.5)  # dups_ok acknowledges within a second
            assert c.terminate(timeout=20) == 0
        assert backend.probe(settings).count(queue) == 0, "acknowledged, not handed back"
    assert calls(backend, "BatchWork") == [1] * 6


def test_on_sqlite_a_long_batch_holds_no_lock_and_mdb_port_stop_answers(tmp_path: Path) -> None:
    """The batch's dedup claims go last on SQLite, so a handler that works for a long time does
    not hold the database's one write lock: ``mdb port stop`` (and the container's own records)
    go through at once, within ``database_timeout``, the busy timeout there."""
    backend = Backend("embedded", tmp_path)
    try:
        queue = backend.q("LONG")
        settings = backend.write(ports={"BatchWork": {"destination": queue, "batch_size": 5,
                                                      "batch_linger": "200ms"}},
                                 database_timeout="2s")
        bodies: list[tuple[str, dict[str, Any]]] = [(f"l-{i}", {"n": i}) for i in range(5)]
        bodies[0] = ("l-0", {"n": 0, "action": "sleep", "seconds": 8})
        send_all(backend, settings, queue, bodies)
        with container(backend, settings) as c:
            wait_for(lambda: attempts_of(backend, "BatchWork")["l-0"], what="the long batch to start")
            began = time.monotonic()
            stopped = mdb("port", "stop", "BatchWork", settings=settings, env=backend.env, cwd=ROOT)
            took = time.monotonic() - began
            assert stopped.returncode == 0, stopped.stderr
            assert backend.effects("BatchWork") == Counter(), f"answered while the batch ran ({took:.1f}s)"
            wait_for(lambda: (c.port_state("BatchWork") or {}).get("state") == "stopped",
                     what="the port stopped")
            wait_for(lambda: len(backend.effects("BatchWork")) == 5, timeout=30,
                     what="the running batch committed")
            log = c.output()
        assert backend.effects("BatchWork") == Counter({f"l-{i}": 1 for i in range(5)})
        assert "database is locked" not in log, log[-3000:]
    finally:
        backend.close()


@pytest.mark.rabbitmq
@pytest.mark.postgres
@pytest.mark.parametrize("transaction", ["none", "container"])
def test_a_lingered_batch_longer_than_two_heartbeats_keeps_its_connection(rabbit: Backend,
                                                                          transaction: str) -> None:
    """heartbeat = 1s, a partial batch (flushed by the linger) whose handler sleeps 3.5s.

    The batch runs between two reads of the connection (``none``), or on the
    batch worker while the consumer goes on reading (``container``); the
    heartbeats must go on meanwhile, or the container's own heartbeat thread
    kills the connection and the batch comes back: applied twice without a
    transaction, backed out at threshold 1 as a crash.
    """
    queue = rabbit.q("LINGER")
    settings = rabbit.write(
        ports={"Work": {"destination": queue, "batch_size": 10, "batch_linger": "200ms",
                        "transaction": transaction, "prefetch": 20}},
        queues={queue: {"backout_threshold": 1}}, heartbeat="1s")
    send_all(rabbit, settings, queue, [("slow", {"action": "sleep", "seconds": 3.5}),
                                       ("quick-1", {"n": 1}), ("quick-2", {"n": 2})])
    with container(rabbit, settings) as c:
        wait_for(lambda: (c.port_state("Work") or {}).get("handled") == 3, 30, what="three handled")
        time.sleep(2.5)  # time for a redelivery, had the connection been killed under the batch
        row = c.port_state("Work") or {}
        output = c.output()
    assert attempts_of(rabbit, "Work") == {"slow": 1, "quick-1": 1, "quick-2": 1}
    assert rabbit.probe(settings).count(queue) == 0
    assert not rabbit.probe(settings).exists(rabbit.q("DLQ")) or \
        rabbit.probe(settings).count(rabbit.q("DLQ")) == 0
    assert row["handled"] == 3 and row["failed"] == 0 and row["backed_out"] == 0, row
    assert "unavailable" not in output and "heartbeat" not in output, output


# -- overlap: batch k's unit of work on the batch worker while the consumer gathers k+1 --------
# (container-managed batches on PostgreSQL; pipeline/batch.py)

def _overlap_settings(rabbit: Backend, queue: str, name: str, linger: str) -> Path:
    return rabbit.write(name=name, ports={"BatchWork": {"destination": queue, "batch_size": 5,
                                                        "batch_linger": linger, "max_retries": 5}})


def _batch_k_and_more(prefix: str, seconds: float) -> list[tuple[str, dict[str, Any]]]:
    """Batch k: five messages, the last sleeping in the handler (so k+1 gathers meanwhile);
    then three more, which make a batch k+1 that the 30 s linger never runs."""
    first = [(f"{prefix}-{i}", {"n": i}) for i in range(4)]
    first.append((f"{prefix}-4", {"n": 4, "action": "sleep", "seconds": seconds}))
    return first + [(f"{prefix}-{i}", {"n": i}) for i in range(5, 8)]


@pytest.mark.rabbitmq
@pytest.mark.postgres
def test_graceful_stop_while_a_batch_is_in_flight_settles_it_and_hands_back_the_next(
        rabbit: Backend) -> None:
    """SIGTERM while batch k sleeps in its handler on the batch worker and k+1 is gathered:
    k commits and is acknowledged (handled once), k+1 goes back uncounted."""
    queue = rabbit.q("OVERLAP")
    settings = _overlap_settings(rabbit, queue, "settings.toml", "30s")
    send_all(rabbit, settings, queue, _batch_k_and_more("s", 3.0))
    with container(rabbit, settings) as c:
        wait_for(lambda: len(attempts_of(rabbit, "BatchWork")) == 5, 30, what="batch k running")
        wait_for(lambda: rabbit.probe(settings).count(queue) == 0, what="k+1 received")
        assert c.terminate(timeout=30) == 0
    assert rabbit.effects("BatchWork") == Counter({f"s-{i}": 1 for i in range(5)}), \
        "the batch in flight committed before the stop"
    assert rabbit.probe(settings).count(queue) == 3, "batch k acknowledged, k+1 handed back"
    short = _overlap_settings(rabbit, queue, "short.toml", "50ms")
    with container(rabbit, short):
        wait_for(lambda: len(rabbit.effects("BatchWork")) == 8, 30, what="k+1 handled")
        time.sleep(0.5)  # time for a stray redelivery of batch k to be skipped or applied
    assert rabbit.effects("BatchWork") == Counter({f"s-{i}": 1 for i in range(8)})
    assert attempts_of(rabbit, "BatchWork") == Counter({f"s-{i}": 1 for i in range(8)})
    assert {a[3] for a in rabbit.attempts("BatchWork")} == {0}, "the hand-back counted no failure"


@pytest.mark.rabbitmq
@pytest.mark.postgres
def test_a_crash_after_a_batch_commits_while_the_next_gathers_applies_each_once(
        rabbit: Backend) -> None:
    """SIGKILL on the batch worker right after batch k's commit, k+1 gathered, nothing
    acknowledged: after a restart, k comes back as duplicates and k+1 is applied, each once."""
    queue = rabbit.q("OVERLAP")
    settings = _overlap_settings(rabbit, queue, "settings.toml", "30s")
    send_all(rabbit, settings, queue, _batch_k_and_more("c", 1.5))
    env = {**rabbit.env, "MDB_TEST_BATCHES": str(rabbit.tmp / "batches.log"),
           "MDB_CRASH_AT": "after-commit:1", "MDB_CRASH_ONCE_FILE": str(rabbit.tmp / "crashed")}
    crashing = ContainerProcess(settings, env=env, cwd=ROOT)
    with crashing:
        wait_for(lambda: (rabbit.tmp / "crashed").exists(), 30, what="the crash after batch k's commit")
        crashing.wait_exit(timeout=20)
    assert rabbit.effects("BatchWork") == Counter({f"c-{i}": 1 for i in range(5)}), "k committed"
    assert rabbit.probe(settings).count(queue) == 8, "nothing acknowledged: all eight come back"
    short = _overlap_settings(rabbit, queue, "short.toml", "50ms")
    with container(rabbit, short) as c:
        wait_for(lambda: len(rabbit.effects("BatchWork")) == 8, 30, what="k+1 handled")
        wait_for(lambda: rabbit.probe(settings).count(queue) == 0, what="the queue drained")
        wait_for(lambda: {k: (c.port_state("BatchWork") or {}).get(k)
                          for k in ("duplicate_skipped", "handled")} == {"duplicate_skipped": 5,
                                                                         "handled": 3},
                 what="five duplicates skipped, three handled")
    assert rabbit.effects("BatchWork") == Counter({f"c-{i}": 1 for i in range(8)}), "each once"
    assert attempts_of(rabbit, "BatchWork") == Counter({f"c-{i}": 1 for i in range(8)}), \
        "batch k's messages never reached the handler again"
