"""Who consumes a durable subscription on the embedded broker: a lock file per queue.

JMS allows one active subscriber per durable subscription. RabbitMQ enforces
it with exclusive consumers; the embedded broker has none, so a container
holds an advisory lock file beside the broker file while it consumes. The
kernel releases it when the process ends, SIGKILL included, so no stale owner
ever has to time out (a row in a database would).
"""

from __future__ import annotations

import fcntl
import os
import re
from pathlib import Path

from ..errors import SubscriptionInUse


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
