"""Redelivery delays (``wire.delays``) on the real brokers, in the test's process.

A failed delivery leaves its queue for a wait queue with a TTL and comes back
by the broker's dead-lettering, carrying its failure; when the wait queue
cannot take it, it stays on its own queue. The wait schedule (delay, backoff,
cap, threshold) is checked as numbers.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from mdbcontainer.settings import QueueSettings, Settings
from mdbcontainer.support.outgoing import Outgoing
from mdbcontainer.testing import wait_for
from mdbcontainer.wire.connection import Broker
from mdbcontainer.wire.delays import (
    MAX_LEVELS,
    Delays,
    came_back,
    carried_failure,
    left_after,
    wait_after,
    wait_arguments,
    wait_queue,
    waits,
)
from mdbcontainer.wire.delivery import Delivery, envelope
from mdbcontainer.wire.headers import EXCEPTION, PORT, PREFIX, REDELIVERY_COUNT, WAIT_EXPIRES_AT, WAITED
from mdbcontainer.wire.publisher import Publisher
from mdbcontainer.wire.queues import QueueSession
from tests.conftest import Backend


def test_each_failure_waits_the_delay_times_the_backoff_up_to_the_cap() -> None:
    q = QueueSettings(redelivery_delay="1s", redelivery_backoff=2.0, redelivery_delay_max="5s")
    assert [wait_after(q, n) for n in (0, 1, 2, 3, 4, MAX_LEVELS + 5)] == [
        timedelta(0), timedelta(seconds=1), timedelta(seconds=2), timedelta(seconds=4),
        timedelta(seconds=5), timedelta(seconds=5)]
    assert wait_after(QueueSettings(), 3) == timedelta(0), "no delay: requeued at once"


def test_a_queue_gets_one_wait_queue_per_distinct_wait_below_its_threshold() -> None:
    """With a threshold of N, failures 1 to N-1 wait; the N-th goes to the backout queue."""
    q = QueueSettings(redelivery_delay="1s", redelivery_backoff=2.0, backout_threshold=4)
    assert waits(q) == [timedelta(seconds=1), timedelta(seconds=2), timedelta(seconds=4)]
    assert [wait_queue("ORDERS", w) for w in waits(q)] == ["ORDERS.wait.1s", "ORDERS.wait.2s",
                                                           "ORDERS.wait.4s"]
    # No threshold: the waits grow until the cap, and past MAX_LEVELS failures a message waits the cap.
    flat = QueueSettings(redelivery_delay="500ms", backout_threshold=0, redelivery_delay_max="1m")
    assert waits(flat) == [timedelta(milliseconds=500), timedelta(minutes=1)]
    assert waits(QueueSettings(backout_threshold=4)) == []


def test_a_wait_queue_dead_letters_back_to_its_queue_and_a_quorum_queue_waits_replicated() -> None:
    classic = wait_arguments("ORDERS", timedelta(seconds=2), quorum=False)
    assert classic == {"x-message-ttl": 2000, "x-dead-letter-exchange": "",
                       "x-dead-letter-routing-key": "ORDERS"}
    quorum = wait_arguments("ORDERS", timedelta(seconds=2), quorum=True)
    assert quorum["x-queue-type"] == "quorum"
    assert quorum["x-dead-letter-strategy"] == "at-least-once", "no message lost on the way back"
    assert quorum["x-overflow"] == "reject-publish", "what RabbitMQ needs for at-least-once"


@contextmanager
def one_held(backend: Backend, delay: str, **properties: Any
             ) -> Iterator[tuple[Settings, str, QueueSession, Publisher, Delivery]]:
    """A queue with ``redelivery_delay = delay``, one message published on it and taken, unacknowledged."""
    queue = backend.q("Q")
    backend.queues.update({wait_queue(queue, w) for w in waits(QueueSettings(redelivery_delay=delay))})
    settings = backend.settings(backend.write(ports={}, queues={queue: {"redelivery_delay": delay}}))
    broker = Broker(settings)
    with QueueSession(broker) as session, Publisher(broker) as publisher:
        exchange, key, mandatory = publisher.route(queue)  # declares it and its wait queue
        publisher.publish(exchange=exchange, routing_key=key, body=b'{"n": 1}', mandatory=mandatory,
                          properties={"message_id": "m-1", "content_type": "application/json",
                                      "headers": {"app": "kept"}, **properties})
        [delivery] = session.hold(queue).take_all()
        yield settings, queue, session, publisher, delivery


def publish_with(publisher: Publisher) -> Callable[[Outgoing], None]:
    """What a port's consumer does with an outgoing copy: confirmed, mandatory, declared once."""
    def publish(message: Outgoing) -> None:
        exchange, key, mandatory = publisher.route(message.destination)
        publisher.publish(exchange=exchange, routing_key=key, body=message.body,
                          properties=message.properties, mandatory=mandatory)
    return publish


def take_when_there(session: QueueSession, queue: str, timeout: float = 15) -> Delivery:
    found: list[Delivery] = []
    wait_for(lambda: bool(found.extend(session.take(queue, 1)) or found), timeout=timeout,
             what=f"the message back on {queue}")
    return found[0]


def test_a_moved_delivery_waits_then_comes_back_with_its_failure_and_the_producers_headers(
        backend: Backend) -> None:
    with one_held(backend, "1s") as (settings, queue, session, publisher, delivery):
        discarded: list[Delivery] = []
        delays = Delays("P", queue, settings.queue(queue), publish=publish_with(publisher),
                        discard=lambda d: (discarded.append(d), d.ack()))
        assert delays.move(delivery, 2, "ValueError: boom")
        assert discarded == [delivery], "the original acknowledged once its copy was confirmed"
        assert session.status(queue).messages == 0, "the consumers go on at once"
        assert session.status(wait_queue(queue, timedelta(seconds=1))).messages == 1

        back = take_when_there(session, queue)
    assert back.message_id == "m-1" and back.body == b'{"n": 1}'
    assert came_back(back), "a redelivery, though the broker does not flag it"
    assert left_after(back) == 2 and carried_failure(back) == "ValueError: boom"
    assert (back.header(WAITED), back.header(PORT), back.header(REDELIVERY_COUNT)) == ("1s", "P", 2)
    message = envelope(back, "m-1", 2, ["application/json"], 1000, queue)
    assert message.headers["app"] == "kept", "the producer's headers as they were"
    assert not [k for k in message.headers if k.startswith(PREFIX)], "none of the wait's (the broker adds x-death)"
    assert message.body == {"n": 1} and message.redelivered


def test_a_wait_queue_that_cannot_take_the_copy_leaves_the_message_on_its_queue(
        backend: Backend) -> None:
    """An operator deleted the wait queue: the copy is unroutable, the original is never acknowledged."""
    with one_held(backend, "1s") as (settings, queue, session, publisher, delivery):
        publish = publish_with(publisher)
        wait = wait_queue(queue, timedelta(seconds=1))
        publisher.route(wait)  # declared once by this publisher, as a consumer's publisher does
        session.delete_if_unused(wait)
        discarded: list[Any] = []
        delays = Delays("P", queue, settings.queue(queue), publish=publish, discard=discarded.append)
        assert not delays.move(delivery, 1, "ValueError: boom"), "requeue it at once instead"
        assert discarded == [] and not delivery.acknowledged
        delivery.requeue()
        again = take_when_there(session, queue)
    assert again.message_id == "m-1" and not came_back(again)
    assert again.header(EXCEPTION) is None


def test_a_copy_keeps_the_expiry_the_broker_would_drop_on_dead_lettering(backend: Backend) -> None:
    """The broker drops ``expiration`` when it dead-letters: the copy carries the instant in a header."""
    stamp = int(time.time())
    with one_held(backend, "1s", expiration="60000", timestamp=stamp) as (settings, queue, _s, _p, delivery):
        delays = Delays("P", queue, settings.queue(queue), publish=lambda m: None, discard=lambda d: None)
        copy = delays.copy(delivery, timedelta(seconds=1), 1, "boom")
        delivery.requeue()
    expires_at = datetime.fromtimestamp(stamp + 60, UTC)
    assert copy.destination == wait_queue(queue, timedelta(seconds=1))
    assert datetime.fromisoformat(copy.properties["headers"][WAIT_EXPIRES_AT]) == expires_at
    left = int(copy.properties["expiration"])
    assert 59_000 < left <= 61_100, "it comes back when its time is up, certainly expired"
    assert copy.properties["message_id"] == "m-1"


@pytest.mark.parametrize("failures", [0, -1])
def test_nothing_waits_before_a_failure(failures: int) -> None:
    assert wait_after(QueueSettings(redelivery_delay="1s"), failures) == timedelta(0)
