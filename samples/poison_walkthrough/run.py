"""Step by step: a poison message, the listener port's Maximum retries, the backout queue.

Run it: ``python samples/poison_walkthrough/run.py`` (``--keep`` keeps the scratch directory).

1. With ``max_retries = 0`` (WebSphere's default) the port stops at each
   failed delivery; ``mdb port start`` starts it again and the poison message
   is delivered again, its redelivery count one higher.
2. After five failed deliveries (``backout_threshold = 5``) the message is
   moved to SYSTEM.DEAD.LETTER.QUEUE, and the orders behind it are processed.
3. With ``max_retries`` at least the threshold, a poison message never stops
   the port: it is backed out after five deliveries while the port runs on.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _support import Walk, main

PORT = "SamplePtoPListenerPort"
QUEUE = "SamplePtoPQueue"


def walk_through(walk: Walk) -> None:
    walk.say("Start the container on the embedded broker")
    container = walk.start()
    container.wait_started(PORT)
    walk.mdb("ports")

    walk.say("Send two orders with a poison message between them")
    walk.mdb("send", QUEUE, '{"order": 1}', "--id", "order-1")
    walk.mdb("send", QUEUE, '"not an order"', "--id", "poison")
    walk.mdb("send", QUEUE, '{"order": 2}', "--id", "order-2")

    for failures in range(1, 6):
        walk.say(f"Failed delivery {failures}: the port stops (max_retries = 0)")
        walk.wait_for(stopped_after(walk, failures), f"the port to stop ({failures})")
        if failures in (1, 5):
            walk.mdb("ports")
        else:
            show_state(walk)
        walk.mdb("port", "start", PORT)

    walk.say("The sixth delivery finds the redelivery count at the threshold: backed out")
    walk.wait_for(lambda: walk.ports()[PORT]["backed_out"] == 1, "the backout")
    walk.wait_for(lambda: container.lines("processed order 2"), "order 2")
    for line in container.lines("poison_listener") + container.lines("backed out"):
        walk.note(line)
    walk.mdb("ports")
    walk.mdb("dlq", "list")
    walk.expect(walk.ports()[PORT]["state"] == "started", "the port runs again")
    walk.expect(len(container.lines("poison message poison")) == 5, "five failed deliveries, no more")
    walk.expect(container.terminate() == 0, "SIGTERM: the container stops cleanly")

    walk.say("Now max_retries = 5 (>= backout_threshold): a poison message never stops the port")
    walk.note("$ export MDB_PORTS__SAMPLEPTOPLISTENERPORT__MAX_RETRIES=5")
    container = walk.start(env={"MDB_PORTS__SAMPLEPTOPLISTENERPORT__MAX_RETRIES": "5"},
                           log_name="container-2.log")
    container.wait_started(PORT)
    walk.mdb("send", QUEUE, '"poison again"', "--id", "poison-2")
    walk.mdb("send", QUEUE, '{"order": 3}', "--id", "order-3")
    walk.wait_for(lambda: container.lines("processed order 3"), "order 3")
    walk.mdb("ports")
    row = walk.ports()[PORT]
    walk.expect(row["state"] == "started" and row["backed_out"] == 1 and row["failed"] == 5,
                "five failed deliveries, backed out, and the port never stopped")
    walk.mdb("dlq", "list")
    walk.expect(container.terminate() == 0, "SIGTERM: the container stops cleanly")


def stopped_after(walk: Walk, failures: int) -> Callable[[], bool]:
    """True once the port shows ``stopped`` after this many failed deliveries."""

    def check() -> bool:
        row = walk.ports().get(PORT, {})
        return row.get("state") == "stopped" and row.get("failed") == failures

    return check


def show_state(walk: Walk) -> None:
    row = walk.ports()[PORT]
    walk.note(f"mdb ports: {PORT} {row['state']}, consecutive failures "
              f"{row['consecutive_failures']}, failed {row['failed']}: {row['reason']}")


if __name__ == "__main__":
    main(walk_through, __file__)
