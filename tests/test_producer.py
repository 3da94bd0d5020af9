"""The Producer a library user keeps open: what happens to its sends when the broker changes under it."""

from __future__ import annotations

import kombu
import pytest

from mdbcontainer.errors import Unroutable
from tests.conftest import RABBITMQ_URL, Backend


@pytest.mark.rabbitmq
def test_a_queue_deleted_under_a_long_lived_producer_is_declared_again(rabbit: Backend) -> None:
    """A publisher declares each destination once. After the queue is deleted (an operator,
    ``rabbitmqctl delete_queue``), a mandatory publish returns: that one fails, and the
    next must declare the queue again instead of failing for the life of the publisher
    (the outbox relay would retry the row for ever)."""
    queue = rabbit.q("Q")
    settings = rabbit.write(ports={"Work": {"destination": queue}}, queues={queue: {}})
    with rabbit.producer(settings) as producer:
        producer.send(queue, {"n": 1})
        with kombu.Connection(RABBITMQ_URL) as conn:
            conn.channel().queue_delete(queue=queue)
        with pytest.raises(Unroutable):
            producer.send(queue, {"n": 2})
        producer.send(queue, {"n": 3})
    assert rabbit.probe(settings).count(queue) == 1
