"""Compare kombu's file-based transports with the embedded SQLite broker.

Publishes N small JSON messages to one queue, then consumes and acks them
with one consumer driven by ``drain_events``, for:

* kombu ``filesystem://`` (data folders in a temp dir),
* kombu ``sqla+sqlite://`` (SQLAlchemy transport),
* ``embedded://`` (mdbcontainer.embedded), with its default
  ``synchronous=NORMAL`` (WAL: safe against a killed process, not against
  power loss) and with ``synchronous=FULL``.

Run: ``python benchmarks/embedded_transports.py [N]``
"""

from __future__ import annotations

import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kombu import Connection, Consumer, Exchange, Producer, Queue

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import mdbcontainer.embedded  # noqa: F401  (registers embedded://)


def filesystem(tmp: Path) -> Connection:
    folder = tmp / "fs"
    folder.mkdir()
    return Connection(
        "filesystem://",
        transport_options={"data_folder_in": str(folder), "data_folder_out": str(folder)},
    )


def sqlalchemy(tmp: Path) -> Connection:
    return Connection(f"sqla+sqlite:///{tmp / 'sqla.db'}")


def embedded(tmp: Path) -> Connection:
    return Connection(f"embedded://{tmp / 'embedded.db'}")


def embedded_full(tmp: Path) -> Connection:
    """fsync on every commit (kombu's sqla+sqlite also runs SQLite's default FULL)."""
    return Connection(
        f"embedded://{tmp / 'embedded.db'}", transport_options={"synchronous": "FULL"}
    )


TRANSPORTS: dict[str, Callable[[Path], Connection]] = {
    "filesystem://": filesystem,
    "sqla+sqlite://": sqlalchemy,
    "embedded://": embedded,
    "embedded:// FULL": embedded_full,
}


def publish(conn: Connection, queue: Queue, n: int) -> float:
    producer = Producer(conn.default_channel)
    started = time.perf_counter()
    for i in range(n):
        producer.publish(
            {"seq": i, "kind": "bench"},
            exchange="",
            routing_key=queue.name,
            serializer="json",
            declare=[queue] if i == 0 else None,
        )
    return time.perf_counter() - started


def consume(conn: Connection, queue: Queue, n: int) -> float:
    received = 0

    def on_message(body: Any, message: Any) -> None:
        nonlocal received
        received += 1
        message.ack()

    started = time.perf_counter()
    with Consumer(conn, [queue], callbacks=[on_message], prefetch_count=1):
        while received < n:
            conn.drain_events(timeout=5)
    return time.perf_counter() - started


def run(factory: Callable[[Path], Connection], n: int) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as tmp, factory(Path(tmp)) as conn:
        name = f"bench-{uuid.uuid4()}"
        queue = Queue(name, Exchange(""), routing_key=name)
        put = publish(conn, queue, n)
        get = consume(conn, queue, n)
        return n / put, n / get


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    print(f"{n} messages, one producer then one consumer (ack each)\n")
    print(f"{'transport':<20}{'publish msg/s':>15}{'consume msg/s':>15}")
    for name, factory in TRANSPORTS.items():
        put, get = run(factory, n)
        print(f"{name:<20}{put:>15,.0f}{get:>15,.0f}")


if __name__ == "__main__":
    main()
