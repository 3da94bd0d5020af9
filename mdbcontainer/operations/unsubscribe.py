"""Durable subscriptions: one active subscriber each, and ``mdb unsubscribe``.

A durable subscription is the durable queue ``CLIENT_ID.SUBSCRIPTION`` bound
to its topic (README: JMS reliability mechanisms): it keeps what is published while its
container is down, until ``mdb unsubscribe`` deletes it. A non-durable one is
an auto-delete queue that goes with its consumers, so what is published while
it is closed is lost (the README's JMS section).

JMS allows one active subscriber per durable subscription. On RabbitMQ the
container consumes with ``exclusive = True``, so a second container is
refused by the broker (ACCESS_REFUSED). The embedded broker has no exclusive
consumers, so a container holds an advisory lock file beside the broker file
while it consumes: the kernel releases it when the process ends, SIGKILL
included, so no stale owner ever has to time out (a row in a database would).
"""

from __future__ import annotations

from ..errors import MdbError
from ..wire.connection import Broker
from ..wire.ownership import OwnerLock, in_use
from ..wire.queues import QueueSession


def unsubscribe(broker: Broker, client_id: str, subscription: str) -> int:
    """Delete durable subscription ``CLIENT_ID.SUBSCRIPTION``; refuse while it is active.

    Returns how many messages it still held (they are discarded with it).
    """
    queue = f"{client_id}.{subscription}"
    lock = None
    if broker.capabilities.local_file:
        lock = OwnerLock.for_queue(broker.embedded_path, queue)
        lock.acquire()  # held while deleting, so no container can start consuming meanwhile
    try:
        return _delete_unused(broker, queue)
    finally:
        if lock is not None:
            lock.release()


def _delete_unused(broker: Broker, queue: str) -> int:
    with QueueSession(broker) as queues:
        found = queues.find(queue)
        if found is None:
            raise MdbError(f"no durable subscription {queue!r} on {broker.masked_url}")
        if found.consumers:
            raise in_use(queue, f"{found.consumers} consumer(s)")
        # if_unused: a container that started consuming since the check keeps it.
        return queues.delete_if_unused(queue)
