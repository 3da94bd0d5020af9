"""Durable subscriptions (seed 001, 5.2.1): one active subscriber each, and ``mdb unsubscribe``.

A durable subscription is the durable queue ``CLIENT_ID.SUBSCRIPTION`` bound
to its topic (contract section 6): it keeps what is published while its
container is down, until ``mdb unsubscribe`` deletes it. A non-durable one is
an auto-delete queue that goes with its consumers, so what is published while
it is closed is lost (the seed's figure 5.1).

JMS allows one active subscriber per durable subscription. On RabbitMQ the
container consumes with ``exclusive = True``, so a second container is
refused by the broker (ACCESS_REFUSED). The embedded broker has no exclusive
consumers, so a container holds an advisory lock file beside the broker file
while it consumes: the kernel releases it when the process ends, SIGKILL
included, so no stale owner ever has to time out (a row in a database would).
"""

from __future__ import annotations

import fcntl
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import MdbError, SubscriptionInUse

if TYPE_CHECKING:
    from .broker import Broker


def in_use(queue: str, detail: str) -> SubscriptionInUse:
    """The one-line refusal, for a second container and for ``mdb unsubscribe`` alike."""
    return SubscriptionInUse(
        f"durable subscription {queue!r} is active ({detail}): JMS allows one active "
        "subscriber; stop the port that consumes it first"
    )


class OwnerLock:
    """The embedded broker's stand-in for an exclusive consumer: a lock file held while consuming."""

    def __init__(self, path: Path, queue: str) -> None:
        self.path = path
        self.queue = queue
        self._fd: int | None = None

    @classmethod
    def for_queue(cls, broker_path: str, queue: str) -> OwnerLock:
        base = Path(broker_path)
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", queue)
        return cls(base.with_name(base.name + ".subscriptions") / f"{safe}.lock", queue)

    def acquire(self) -> None:
        """Take the lock without waiting; SubscriptionInUse naming the owner's pid otherwise."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            owner = os.pread(fd, 64, 0).decode(errors="replace").strip()
            os.close(fd)
            raise in_use(self.queue, f"consumed by pid {owner or '?'}") from exc
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._fd = fd

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


def embedded_path(broker: Broker) -> str:
    """The embedded broker's file, as ``Broker.connection`` resolves it."""
    from .broker import EMBEDDED

    return broker.url[len(EMBEDDED):] or ".mdb/broker.db"


def unsubscribe(broker: Broker, client_id: str, subscription: str) -> int:
    """Delete durable subscription ``CLIENT_ID.SUBSCRIPTION``; refuse while it is active.

    Returns how many messages it still held (they are discarded with it).
    """
    queue = f"{client_id}.{subscription}"
    lock = None
    if broker.capabilities.name == "embedded":
        lock = OwnerLock.for_queue(embedded_path(broker), queue)
        lock.acquire()  # held while deleting, so no container can start consuming meanwhile
    try:
        return _delete_unused(broker, queue)
    finally:
        if lock is not None:
            lock.release()


def _delete_unused(broker: Broker, queue: str) -> int:
    from amqp.exceptions import NotFound

    conn = broker.connect()
    try:
        channel = conn.channel()
        try:
            ok = channel.queue_declare(queue=queue, passive=True)
        except NotFound as exc:
            raise MdbError(f"no durable subscription {queue!r} on {broker.masked_url}") from exc
        if ok.consumer_count:
            raise in_use(queue, f"{ok.consumer_count} consumer(s)")
        # if_unused: a container that started consuming since the check keeps it.
        return int(channel.queue_delete(queue=queue, if_unused=True) or 0)
    finally:
        conn.close()
