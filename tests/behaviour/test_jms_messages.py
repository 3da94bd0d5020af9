"""JMS mechanisms (README): persistence, priority and expiration, as a handler sees them."""

from __future__ import annotations

import socket
import time
import urllib.request

import kombu
import pytest

from mdbcontainer.sending.producer import Outgoing, outgoing
from mdbcontainer.testing import headers_of, mdb, wait_for
from tests.apps.jms import records
from tests.conftest import RABBITMQ_URL, Backend, jms_settings

pytestmark = pytest.mark.slow


def test_messages_are_persistent_with_priority_4_unless_told_otherwise(backend: Backend) -> None:
    queue = backend.q("PERSIST")
    settings = jms_settings(backend, queue, transaction="none")
    for body, flags in (('{"n": 1}', []), ('{"n": 2}', ["--non-persistent", "--priority", "7"])):
        result = mdb("send", queue, body, *flags, settings=settings, env=backend.env)
        assert result.returncode == 0, result.stderr
    with backend.container(settings):
        wait_for(lambda: len(records(backend.log)) == 2, what="both messages")
    seen = {r["n"]: (r["persistent"], r["priority"]) for r in records(backend.log)}
    assert seen == {1: (True, 4), 2: (False, 7)}


def test_higher_priorities_are_delivered_first_when_messages_wait_together(backend: Backend) -> None:
    queue = backend.q("PRIO")
    settings = jms_settings(backend, queue, queues={queue: {"max_priority": 9}}, transaction="none",
                            prefetch=1)
    sent = [("a", 1), ("b", 9), ("c", None), ("d", 0), ("e", 7), ("f", 9), ("g", 4)]
    with backend.producer(settings) as producer:  # no container runs: they wait together
        for n, priority in sent:
            producer.send(queue, {"n": n}, priority=priority, message_id=n)
    with backend.container(settings):
        wait_for(lambda: len(records(backend.log)) == len(sent), what="every message")
    handled = [(r["n"], r["priority"]) for r in records(backend.log)]
    assert handled == [("b", 9), ("f", 9), ("e", 7), ("c", 4), ("g", 4), ("a", 1), ("d", 0)]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def expired_metric(port: int) -> float | None:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for line in text.splitlines():
        labels, _, value = line.partition("} ")
        if labels.startswith("mdb_deliveries_total{") and 'outcome="expired"' in labels \
                and 'port="Jms"' in labels:
            return float(value)
    return None


def test_expired_messages_never_reach_the_handler_and_go_to_the_expiry_queue(backend: Backend) -> None:
    queue, expired = backend.q("TTL"), backend.q("EXPIRED")
    metrics = free_port()
    settings = backend.write(
        ports={"Jms": {"destination": queue, "transaction": "none"}},
        queues={queue: {"expiry_queue": expired}}, listeners=["tests.apps.jms"],
        metrics_port=metrics, metrics_host="127.0.0.1",
    )
    with backend.producer(settings) as producer:
        # Expired by the broker while it waits (no container runs).
        producer.send(queue, {"n": "ttl"}, ttl="1s", message_id="ttl")
        # Sent two minutes ago with a minute to live (a late message, say from a shovel):
        # the broker counts its ttl from arrival, the container from the send time.
        stale = outgoing(queue, {"n": "stale"}, ttl="60s", message_id="stale")
        producer.publish(Outgoing(queue, stale.body, {**stale.properties,
                                                      "timestamp": int(time.time()) - 120}))
        producer.send(queue, {"n": "fresh"}, ttl="5m", message_id="fresh")
    time.sleep(1.5)
    with backend.container(settings) as container:
        wait_for(lambda: records(backend.log), what="the fresh message")
        wait_for(lambda: (container.port_state("Jms") or {}).get("expired") == 1,
                 what="the stale message counted as expired at receipt")
        row = container.port_state("Jms") or {}
        assert expired_metric(metrics) == 1.0
    assert [r["n"] for r in records(backend.log)] == ["fresh"]
    assert (row["delivered"], row["handled"]) == (1, 1)
    kept = {m.properties["message_id"]: m for m in backend.probe(settings).take_all(expired)}
    assert set(kept) == {"ttl", "stale"}
    assert "x-mdb-expired-at" in headers_of(kept["stale"])
    assert all("expiration" not in m.properties for m in kept.values()), "kept, not expiring again"


def test_without_an_expiry_queue_expired_messages_are_dropped(backend: Backend) -> None:
    queue = backend.q("TTL")
    settings = jms_settings(backend, queue, transaction="none")
    with backend.producer(settings) as producer:
        producer.send(queue, {"n": "ttl"}, ttl="500ms", message_id="ttl")
        producer.send(queue, {"n": "fresh"}, message_id="fresh")
    time.sleep(1.0)
    with backend.container(settings):
        wait_for(lambda: records(backend.log), what="the fresh message")
        wait_for(lambda: backend.probe(settings).count(queue) == 0, what="an empty queue")
    assert [r["n"] for r in records(backend.log)] == ["fresh"]
    assert backend.probe(settings).count(backend.q("DLQ")) == 0


@pytest.mark.rabbitmq
def test_a_message_without_delivery_mode_is_not_persistent(rabbit: Backend) -> None:
    """``persistent`` (README). AMQP without a delivery_mode is transient (RabbitMQ keeps it
    in memory only), so a producer from elsewhere that sets none must not read as persistent."""
    import amqp

    queue = rabbit.q("Q")
    settings = jms_settings(rabbit, queue, transaction="none")
    with rabbit.container(settings):
        with rabbit.producer(settings) as producer:
            producer.send(queue, {"n": 1}, message_id="ours")
            producer.send(queue, {"n": 2}, message_id="ours-transient", persistent=False)
        with kombu.Connection(RABBITMQ_URL) as conn:
            raw = amqp.Message(b'{"n": 3}', content_type="application/json", message_id="foreign")
            conn.default_channel.basic_publish(raw, exchange="", routing_key=queue)
        wait_for(lambda: len(records(rabbit.log)) == 3, what="three deliveries")
    persistent = {row["id"]: row["persistent"] for row in records(rabbit.log)}
    assert persistent == {"ours": True, "ours-transient": False, "foreign": False}
