"""Batched ports (contract section 8), as a user sees them: rows committed once, what was
acknowledged, what the failing message alone counted, and the batch figures.

Each test runs ``mdb run`` on the embedded broker + SQLite and on RabbitMQ +
PostgreSQL. The handlers are tests/apps/batched.py (batch handlers) and
tests/apps/work.py (a per-message handler on a batched port).
"""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from mdbcontainer.testing import ContainerProcess, wait_for
from tests.conftest import ROOT, Backend

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
        result = subprocess.run([sys.executable, "-m", "mdbcontainer", "check", "-c", str(settings)],
                                capture_output=True, text=True, cwd=ROOT, env={**backend.env},
                                timeout=60)
    finally:
        backend.close()
    assert result.returncode == 2, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and culprit in lines[0], result.stderr
    assert "Traceback" not in result.stderr


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
    from mdbcontainer.wire.broker import Broker, Publish, Publisher

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
