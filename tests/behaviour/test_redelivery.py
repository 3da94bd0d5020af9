"""Redelivery: the delay before a failed message is offered again, quorum queues, invalid bodies."""

from __future__ import annotations

import itertools

import pytest

from mdbcontainer.testing import wait_for
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
