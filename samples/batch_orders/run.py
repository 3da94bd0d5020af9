"""Batches, step by step: 200 orders stored with a handful of commits, each exactly once.

Run it: ``python samples/batch_orders/run.py`` (``--keep`` keeps the scratch directory).

1. 200 orders are sent while the port is stopped, then the port starts: the
   batch handler is called with up to 50 orders at a time (``mdb ports``
   shows the batches and how full they ran).
2. A producer's retry sends an order again with the same id: it is skipped
   without reaching the handler, in whichever batch it lands.
3. An order with a negative amount makes the handler raise: its batch rolls
   back and every order of it runs again alone; only the bad one fails and
   goes to the backout queue, the others are stored once.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _support import Walk, main
from sqlalchemy import create_engine, text

from mdbcontainer.operations.ports import batch_figures
from mdbcontainer.sending.producer import Producer
from mdbcontainer.testing import QueueProbe

PORT = "OrdersPort"
QUEUE = "ORDERS"


def walk_through(walk: Walk) -> None:
    walk.say("Start the container with the port stopped, and send 200 orders")
    walk.mdb("port", "stop", PORT)
    container = walk.start()
    walk.wait_for(lambda: PORT in walk.ports(), "the container")
    with Producer.from_settings(walk.settings) as producer:
        for i in range(200):
            producer.send(QUEUE, {"sku": f"SKU-{i % 7}", "amount": 1 + i % 5}, message_id=f"order-{i}")
    walk.mdb("port", "start", PORT)
    walk.wait_for(lambda: QueueProbe(walk.settings).count(QUEUE) == 0, "the queue to drain")
    walk.wait_for(lambda: walk.ports()[PORT]["handled"] == 200, "200 orders handled")
    show_port(walk)
    batches = walk.ports()[PORT]["batches"]
    walk.expect(batches <= 20, f"200 orders in {batches} batches, not 200 commits")

    walk.say("The producer retries order-7 (same id), and sends order-bad with amount -3")
    with Producer.from_settings(walk.settings) as producer:
        producer.send(QUEUE, {"sku": "SKU-0", "amount": 3}, message_id="order-7")
        for i in range(200, 230):
            producer.send(QUEUE, {"sku": "SKU-1", "amount": 2}, message_id=f"order-{i}")
            if i == 215:
                producer.send(QUEUE, {"sku": "SKU-9", "amount": -3}, message_id="order-bad")
    walk.wait_for(lambda: walk.ports()[PORT]["handled"] == 230, "230 orders handled")
    walk.wait_for(lambda: walk.ports()[PORT]["duplicate_skipped"] == 1, "the duplicate skipped")
    show_port(walk)
    for line in container.lines("rolled back")[:1]:
        walk.note(line)
    dead = walk.mdb("dlq", "list", "--json", show=False)
    ids = [m["id"] for m in json.loads(dead.stdout)]
    walk.note(f"backout queue: {ids}")
    walk.expect(ids == ["order-bad"], "only the bad order is in the backout queue")
    stored = orders(walk)
    walk.note(f"stored: {len(stored)} orders, {len(set(stored))} distinct ids")
    walk.expect(len(stored) == 230 and len(set(stored)) == 230,
                "230 orders stored, each exactly once")
    walk.expect(container.terminate() == 0, "SIGTERM: the container stops cleanly")


def show_port(walk: Walk) -> None:
    row = walk.ports()[PORT]
    walk.note(f"mdb ports: {PORT} handled {row['handled']}, duplicate skipped "
              f"{row['duplicate_skipped']}, failed {row['failed']}, batches {batch_figures(row)}")


def orders(walk: Walk) -> list[str]:
    engine = create_engine(walk.settings.container.database_url)
    try:
        with engine.connect() as conn:
            return [row[0] for row in conn.execute(text("SELECT message_id FROM sample_orders"))]
    finally:
        engine.dispose()


if __name__ == "__main__":
    main(walk_through, __file__)
