"""Redelivery: the delay before a failed message is offered again, quorum queues, invalid bodies."""

from __future__ import annotations

import itertools
import os
import socket
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from mdbcontainer.settings import settings_from_dict
from mdbcontainer.state.counts import CRASHED, DeliveryCounter
from mdbcontainer.state.store import Store, utcnow
from mdbcontainer.testing import wait_for
from tests.behaviour.helpers import consumer_connection, table
from tests.conftest import Backend, rabbitmqctl

pytestmark = pytest.mark.slow


def test_redelivery_delay_with_exponential_backoff(backend: Backend) -> None:
    queue = backend.q("DELAYED")
    settings = backend.write(
        ports={"Work": {"destination": queue, "max_retries": 10, "prefetch": 1}},
        queues={queue: {"backout_threshold": 4, "redelivery_delay": "300ms",
                        "redelivery_backoff": 2.0, "redelivery_delay_max": "1s"}},
    )
    with backend.producer(settings) as producer:
        producer.send(queue, {"n": 1, "action": "fail"}, message_id="slowpoke")
    with backend.container(settings):
        wait_for(lambda: backend.probe(settings).count(backend.q("DLQ")) == 1, timeout=30,
                 what="the backout after four deliveries")
    times = backend.attempt_times("slowpoke")
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert len(times) == 4
    # 300 ms, then 600 ms, then capped at 1 s (each plus scheduling slack)
    for gap, expected in zip(gaps, [0.3, 0.6, 1.0], strict=True):
        assert expected <= gap < expected + 0.8, gaps


@pytest.mark.rabbitmq
def test_quorum_queue_counts_and_backs_out(rabbit: Backend) -> None:
    queue = rabbit.q("QUORUM")
    settings = rabbit.write(
        ports={"Work": {"destination": queue, "max_retries": 5}},
        queues={queue: {"quorum": True, "backout_threshold": 3}},
    )
    with rabbit.producer(settings) as producer:
        producer.send(queue, {"n": 1, "action": "fail"}, message_id="poison")
        producer.send(queue, {"n": 2}, message_id="good")
    with rabbit.container(settings):
        wait_for(lambda: rabbit.probe(settings).count(rabbit.q("DLQ")) == 1, what="backout")
        wait_for(lambda: "good" in rabbit.effects(), what="the good message")
    assert [a[3] for a in rabbit.attempts() if a[1] == "poison"] == [0, 1, 2]
    listed = rabbitmqctl("list_queues", "--quiet", "--no-table-headers", "name", "type")
    types = dict(line.split("\t")[:2] for line in listed.splitlines() if "\t" in line)
    assert types[queue] == "quorum", "declared with x-queue-type = quorum"
    [dead] = rabbit.probe(settings).take_all(rabbit.q("DLQ"))
    assert dict(dead.headers)["x-mdb-redelivery-count"] == 3


def test_invalid_bodies_are_backed_out_at_once_without_touching_the_port(backend: Backend) -> None:
    queue = backend.q("TYPED")
    settings = backend.write(ports={"Typed": {"destination": queue}})
    good = {"order_id": 1, "amount": "2.50"}
    with backend.producer(settings) as producer:
        producer.send(queue, {"order_id": "not a number", "amount": "1"}, message_id="bad-type")
        producer.send(queue, "plain text", message_id="text-for-a-model")
        producer.send(queue, good, message_id="good")
    with backend.container(settings) as container:
        wait_for(lambda: "good" in backend.effects(), what="the good message")
        wait_for(lambda: backend.probe(settings).count(backend.q("DLQ")) == 2, what="backouts")
        state = container.port_state("Typed")
        assert state["state"] == "started" and state["consecutive_failures"] == 0
    dead = {m.properties["message_id"]: dict(m.headers) for m in
            backend.probe(settings).take_all(backend.q("DLQ"))}
    assert dead["bad-type"]["x-mdb-backout-reason"] == "invalid-body"
    assert "order_id" in dead["bad-type"]["x-mdb-exception"]
    assert dead["bad-type"]["x-mdb-redelivery-count"] == 0
    assert dead["text-for-a-model"]["x-mdb-backout-reason"] == "invalid-body"


def unsettled(queue: str) -> int:
    """Messages of ``queue`` ready or delivered and not yet acknowledged (``rabbitmqctl list_queues``)."""
    return sum(int(row[1]) for row in table("list_queues", "name", "messages") if row[0] == queue)


def lost_connection_settings(rabbit: Backend, queue: str) -> Path:
    return rabbit.write(
        ports={"Work": {"destination": queue, "prefetch": 20, "concurrency": 1, "max_retries": 50}},
        queues={queue: {"backout_threshold": 1}}, heartbeat="5s")


def send_slow(rabbit: Backend, settings: Path, queue: str, seconds: float) -> None:
    """Twenty messages whose handler sleeps ``seconds``: the consumer prefetches them all."""
    with rabbit.producer(settings) as producer:
        for n in range(20):
            producer.send(queue, {"n": n, "action": "sleep", "seconds": seconds}, message_id=f"m-{n}")


@pytest.mark.rabbitmq
@pytest.mark.postgres
def test_a_connection_closed_under_a_living_container_counts_nothing(rabbit: Backend) -> None:
    """backout_threshold = 1, twenty prefetched, an operator closes the consumer's connection.

    The container lives on and reconnects: the message in its handler and the
    prefetched ones it never saw come back uncounted, so none is backed out
    as a crash, and every one is applied once.
    """
    queue = rabbit.q("CLOSED")
    settings = lost_connection_settings(rabbit, queue)
    send_slow(rabbit, settings, queue, 0.3)
    with rabbit.container(settings) as container:
        wait_for(lambda: len(rabbit.attempts()) >= 3, 20, what="the first deliveries")
        rabbitmqctl("close_connection", consumer_connection(queue), "closed by a test operator")
        wait_for(lambda: len(rabbit.effects()) == 20, 60, what="every message handled")
        # Deliveries handled on the closed connection could not be acknowledged: they come
        # back once the consumer is back, as duplicates acknowledged unrun.
        wait_for(lambda: unsettled(queue) == 0, 30, interval=0.5, what="the redelivered copies acknowledged")
        wait_for(lambda: (container.port_state("Work") or {}).get("state") == "started",
                 what="the port consuming again")
        row = container.port_state("Work") or {}
        output = container.output()
    assert "broker unavailable" in output, output  # the close reached it (or a reset after it)
    probe = rabbit.probe(settings)
    assert not probe.exists(rabbit.q("DLQ")) or probe.count(rabbit.q("DLQ")) == 0, \
        "messages of a living container were backed out as crashes"
    assert set(rabbit.effects().values()) == {1}
    assert probe.count(queue) == 0
    assert row["backed_out"] == 0 and row["failed"] == 0, row
    assert all(a[3] == 0 for a in rabbit.attempts()), "a redelivery counted a failed delivery"


@pytest.mark.rabbitmq
@pytest.mark.postgres
def test_a_competing_consumer_does_not_charge_a_living_containers_lost_deliveries(
        rabbit: Backend) -> None:
    """Two containers; the first's connection is closed while it holds twenty.

    The second receives the first's deliveries back before the first has
    noticed or written anything: it must not charge them (the first's lease
    is open and its process alive), so none is backed out.
    """
    queue = rabbit.q("COMPETED")
    settings = lost_connection_settings(rabbit, queue)
    send_slow(rabbit, settings, queue, 0.5)
    with rabbit.container(settings) as first:
        wait_for(lambda: len(rabbit.attempts()) >= 2, 20, what="the first deliveries")
        name = consumer_connection(queue)  # the first's, before the second consumes
        with rabbit.container(settings, log_path=rabbit.tmp / "second.log") as second:
            rabbitmqctl("close_connection", name, "closed by a test operator")
            wait_for(lambda: len(rabbit.effects()) == 20, 60, what="every message handled")

            def both() -> list[dict[str, Any]]:
                return [first.port_state("Work") or {}, second.port_state("Work") or {}]

            wait_for(lambda: both()[1].get("delivered", 0) > 0, what="the second's figures")
            rows = both()
            output = first.output()
    assert "broker unavailable" in output, output  # the close reached it (or a reset after it)
    probe = rabbit.probe(settings)
    assert not probe.exists(rabbit.q("DLQ")) or probe.count(rabbit.q("DLQ")) == 0, \
        "a living container's deliveries were backed out as crashes by its competitor"
    assert set(rabbit.effects().values()) == {1}
    assert all(row["backed_out"] == 0 and row["failed"] == 0 for row in rows), rows


def test_an_unclosed_delivery_counts_only_when_a_lease_of_its_queue_shows_a_death(tmp_path: Path) -> None:
    """The evidence, one lease at a time: a living holder counts nothing, a dead one counts once.

    Dead is a process gone from this host (a zombie included), or this very
    pid under another container id: a restarted container (pid 1 in a
    container image) gets its pid back, and its earlier life's lease must
    still count as a death.
    """
    settings = settings_from_dict({"container": {"database_url": f"sqlite:///{tmp_path}/c.db"}})
    store = Store(settings.container)
    store.create_tables()
    counter = DeliveryCounter(store)
    counter.begin_lease("q", "me")

    def lease_of(pid: int, container: str) -> str:
        lease = uuid.uuid4().hex
        with store.engine.begin() as conn:
            conn.execute(store.tables.lease.insert().values(
                id=lease, queue="q", container=container, host=socket.gethostname(), pid=pid,
                started_at=utcnow(), ended_at=None, died=False))
        return lease

    try:
        alive = lease_of(os.getppid(), "parent")
        assert counter.open("q", "lost-live").count == 0, "a living holder's delivery counted"
        counter.end_lease(alive)
        assert counter.open("q", "ended").count == 0

        gone = subprocess.Popen([sys.executable, "-c", "pass"])
        gone.wait()
        lease_of(gone.pid, "dead")
        crashed = counter.open("q", "killer")
        assert (crashed.count, crashed.last_exception) == (1, CRASHED)
        assert counter.open("q", "killer").count == 2, "each unclosed delivery counts once"
        counter.fail("q", "killer", "boom")
        assert counter.open("q", "killer").count == 3
    finally:
        store.engine.dispose()

    other = tmp_path / "reused"
    other.mkdir()
    settings = settings_from_dict({"container": {"database_url": f"sqlite:///{other}/c.db"}})
    store = Store(settings.container)
    store.create_tables()
    try:
        counter = DeliveryCounter(store)
        with store.engine.begin() as conn:
            conn.execute(store.tables.lease.insert().values(
                id="earlier-life", queue="q", container="before-restart", host=socket.gethostname(),
                pid=os.getpid(), started_at=utcnow(), ended_at=None, died=False))
        counter.begin_lease("q", "after-restart")
        assert counter.open("q", "killer").count == 1, "a lease of this pid's earlier life"
    finally:
        store.engine.dispose()


@pytest.mark.rabbitmq
@pytest.mark.postgres
def test_an_old_crash_on_the_queue_does_not_charge_a_later_live_loss(rabbit: Backend) -> None:
    """An idle container of the queue is SIGKILLed (its lease stays open, its holder gone); later
    an operator closes the connection of a living async container holding twenty: what that
    consumer had seen (the task, the waiting line) goes back uncounted, none as a crash."""
    queue = rabbit.q("OLDCRASH")
    settings = rabbit.write(
        ports={"AsyncWork": {"destination": queue, "transaction": "container", "prefetch": 20,
                             "max_retries": 50}},
        queues={queue: {"backout_threshold": 1}}, heartbeat="5s")
    with rabbit.container(settings, log_path=rabbit.tmp / "idle.log") as idle:
        wait_for(lambda: (idle.port_state("AsyncWork") or {}).get("state") == "started",
                 what="the idle container consuming")
        idle.kill()
    reached, go = rabbit.tmp / "reached", rabbit.tmp / "go"
    with rabbit.producer(settings) as producer:  # the first waits in its handler, the rest in line
        producer.send(queue, {"n": 0, "pause": [str(reached), str(go)]}, message_id="m-0")
        for n in range(1, 20):
            producer.send(queue, {"n": n}, message_id=f"m-{n}")
    with rabbit.container(settings) as living:
        wait_for(reached.exists, 20, what="the first delivery in its handler")
        rabbitmqctl("close_connection", consumer_connection(queue), "closed by a test operator")
        wait_for(lambda: "broker connection restored" in living.output(), 20, what="the reconnect")
        go.touch()
        probe = rabbit.probe(settings)
        wait_for(lambda: len(rabbit.effects()) + probe.count(rabbit.q("DLQ")) == 20, 60,
                 what="every message handled or backed out")
        wait_for(lambda: unsettled(queue) == 0, 30, interval=0.5, what="the redelivered copies settled")
        output = living.output()
    assert "broker unavailable" in output, output
    assert not probe.exists(rabbit.q("DLQ")) or probe.count(rabbit.q("DLQ")) == 0, \
        "a live loss was charged as a crash: " + output[-3000:]
    assert set(rabbit.effects().values()) == {1}
    assert all(a[3] == 0 for a in rabbit.attempts()), "a redelivery counted a failed delivery"


def test_two_non_durable_subscriptions_count_their_copies_apart(embedded: Backend) -> None:
    """Two ports subscribe to one topic without a durable subscription; both copies of a poison
    message fail. Each port counts its own copy: delivered five times, then backed out."""
    topic = embedded.q("NEWS")
    settings = embedded.write(
        ports={"Work": {"topic": topic, "transaction": "none", "max_retries": 50},
               "Downstream": {"topic": topic, "max_retries": 50}},
        topics={topic: {}})
    with embedded.container(settings) as container:
        wait_for(lambda: all((container.port_state(p) or {}).get("state") == "started"
                             for p in ("Work", "Downstream")), what="both ports subscribed")
        with embedded.producer(settings) as producer:
            producer.send(topic, {"n": 1, "action": "fail"}, message_id="poison")
        wait_for(lambda: embedded.probe(settings).count(embedded.q("DLQ")) == 2, 30,
                 what="both copies backed out")
    for port in ("Work", "Downstream"):
        assert [a[3] for a in embedded.attempts(port)] == [0, 1, 2, 3, 4], (port, embedded.attempts())


@pytest.mark.rabbitmq
@pytest.mark.postgres
def test_what_the_broker_dead_letters_from_a_quorum_queue_lands_in_its_backout_queue(
        rabbit: Backend) -> None:
    """The broker's delivery limit (2, by a policy on this test's queue only; RabbitMQ 4 sets 20
    on every quorum queue) ends a message before the backout threshold (5): the broker's
    dead-lettering takes it to the backout queue, with its reason, instead of dropping it."""
    queue = rabbit.q("QLIMIT")
    policy = f"mdb-test-{rabbit.tag}"
    settings = rabbit.write(
        ports={"Work": {"destination": queue, "max_retries": 10}},
        queues={queue: {"quorum": True, "backout_threshold": 5}})
    rabbitmqctl("set_policy", "--apply-to", "queues", policy, f"^{queue}$", '{"delivery-limit": 2}')
    try:
        with rabbit.producer(settings) as producer:
            producer.send(queue, {"n": 1, "action": "fail"}, message_id="poison")
        with rabbit.container(settings):
            wait_for(lambda: rabbit.probe(settings).count(rabbit.q("DLQ")) == 1, 30,
                     what="the message the broker gave up on, in the backout queue")
    finally:
        rabbitmqctl("clear_policy", policy)
    [dead] = rabbit.probe(settings).take_all(rabbit.q("DLQ"))
    assert dead.properties["message_id"] == "poison"
    [death] = dict(dead.headers)["x-death"]
    assert death["reason"] == "delivery_limit" and death["queue"] == queue, death
    assert rabbit.probe(settings).count(queue) == 0


@pytest.mark.rabbitmq
@pytest.mark.postgres
def test_a_quorum_queue_declared_before_its_dead_lettering_still_consumes_with_a_warning(
        rabbit: Backend) -> None:
    """A quorum queue an earlier version declared (no dead-letter arguments): the broker refuses
    a declare with other arguments, so the container keeps the queue's and says how to add it."""
    import kombu

    from tests.conftest import RABBITMQ_URL

    queue = rabbit.q("QOLD")
    with kombu.Connection(RABBITMQ_URL) as conn:
        conn.channel().queue_declare(queue=queue, durable=True, auto_delete=False,
                                     arguments={"x-queue-type": "quorum"})
    settings = rabbit.write(ports={"Work": {"destination": queue, "max_retries": 5}},
                            queues={queue: {"quorum": True}})
    with rabbit.producer(settings) as producer:
        producer.send(queue, {"n": 1}, message_id="ok")
    with rabbit.container(settings) as container:
        wait_for(lambda: "ok" in rabbit.effects(), 30, what="the message handled")
        output = container.output()
    assert f"quorum queue '{queue}' was declared without dead-lettering" in output, output
