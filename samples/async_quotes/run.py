"""Async handlers, step by step: 200 quotes that each wait 100 ms, stored in well under 20 s.

Run it: ``python samples/async_quotes/run.py`` (``--keep`` keeps the scratch directory).

1. 200 quote requests are sent while the port is stopped, then the port
   starts: its ``async def`` handler awaits a 100 ms pricing call, 50 at a
   time on one event loop, so the 200 are stored in about half a second
   (one by one they would take 20 s).
2. A producer's retry sends a request again with the same id: it is skipped
   without reaching the handler; every quote is stored exactly once.
3. SIGTERM: the container stops cleanly (exit 0).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _support import Walk, main
from sqlalchemy import create_engine, text

from mdbcontainer.sending.producer import Producer
from mdbcontainer.testing import QueueProbe

PORT = "QuotesPort"
QUEUE = "QUOTES"


def walk_through(walk: Walk) -> None:
    walk.say("Start the container with the port stopped, and send 200 quote requests")
    walk.mdb("port", "stop", PORT)
    container = walk.start()
    walk.wait_for(lambda: PORT in walk.ports(), "the container")
    with Producer.from_settings(walk.settings) as producer:
        for i in range(200):
            producer.send(QUEUE, {"sku": f"SKU-{i % 7}", "quantity": 1 + i % 3}, message_id=f"quote-{i}")
    started = time.monotonic()
    walk.mdb("port", "start", PORT)
    walk.wait_for(lambda: walk.ports()[PORT]["handled"] == 200, "200 quotes handled")
    elapsed = time.monotonic() - started
    walk.note(f"200 handlers waiting 100 ms each, 50 at a time: {elapsed:.1f}s from mdb port start")
    walk.expect(elapsed < 15, f"the waits overlapped ({elapsed:.1f}s, not 20s one by one)")

    walk.say("The producer retries quote-7 (same id)")
    with Producer.from_settings(walk.settings) as producer:
        producer.send(QUEUE, {"sku": "SKU-0", "quantity": 1}, message_id="quote-7")
    walk.wait_for(lambda: walk.ports()[PORT]["duplicate_skipped"] == 1, "the duplicate skipped")
    walk.wait_for(lambda: QueueProbe(walk.settings).count(QUEUE) == 0, "the queue to drain")
    stored = quotes(walk)
    walk.note(f"stored: {len(stored)} quotes, {len(set(stored))} distinct ids")
    walk.expect(len(stored) == 200 and len(set(stored)) == 200, "200 quotes stored, each exactly once")
    walk.expect(container.terminate() == 0, "SIGTERM: the container stops cleanly")


def quotes(walk: Walk) -> list[str]:
    engine = create_engine(walk.settings.container.database_url)
    try:
        with engine.connect() as conn:
            return [row[0] for row in conn.execute(text("SELECT message_id FROM sample_quotes"))]
    finally:
        engine.dispose()


if __name__ == "__main__":
    main(walk_through, __file__)
