"""Step by step (README: JMS reliability mechanisms): durable and non-durable topic subscriptions.

Run it: ``python samples/durable_subscription/run.py`` (``--keep`` keeps the scratch directory).

1. Both subscribers get the events published while the container runs.
2. The container stops; three events are published. The durable subscription
   (the queue ``audit-service.audit``) keeps them; the non-durable one went
   away with its process.
3. After a restart the audit port receives the three it missed; the
   dashboard port does not.
4. ``mdb unsubscribe audit-service audit`` deletes the durable subscription:
   what is published afterwards is kept for nobody.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _support import Container, Walk, main

from mdbcontainer.testing import QueueProbe

TOPIC = "orders.events"
SUBSCRIPTION_QUEUE = "audit-service.audit"


def walk_through(walk: Walk) -> None:
    walk.say("Start the container: a durable and a non-durable subscriber")
    container = walk.start()
    container.wait_started("AuditPort", "DashboardPort")
    publish(walk, 1, 2)
    walk.wait_for(lambda: len(got(container, "audit")) == 2 and len(got(container, "dashboard")) == 2,
                  "both subscribers to get events 1 and 2")
    walk.expect(got(container, "audit") == got(container, "dashboard") == ["1", "2"],
                "both subscribers got events 1 and 2")
    walk.expect(container.terminate() == 0, "SIGTERM: the container stops")

    walk.say("While no subscriber runs, publish events 3, 4 and 5")
    publish(walk, 3, 4, 5)
    held = QueueProbe(walk.settings).count(SUBSCRIPTION_QUEUE)
    walk.expect(held == 3, f"the durable subscription {SUBSCRIPTION_QUEUE} holds {held} events")

    walk.say("Restart: the durable subscriber receives what it missed")
    container = walk.start(log_name="container-2.log")
    container.wait_started("AuditPort", "DashboardPort")
    walk.wait_for(lambda: len(got(container, "audit")) == 3, "events 3 to 5 on the audit port")
    publish(walk, 6)
    walk.wait_for(lambda: got(container, "dashboard") == ["6"], "event 6 on the dashboard port")
    walk.wait_for(lambda: len(got(container, "audit")) == 4, "event 6 on the audit port")
    for line in container.lines("got event"):
        walk.note(line)
    walk.expect(got(container, "audit") == ["3", "4", "5", "6"], "audit: 3, 4, 5 (missed) and 6")
    walk.expect(got(container, "dashboard") == ["6"], "dashboard: only 6 (3 to 5 were not kept for it)")
    walk.expect(container.terminate() == 0, "SIGTERM: the container stops")

    walk.say("Delete the durable subscription; what comes next is kept for nobody")
    walk.mdb("unsubscribe", "audit-service", "audit")
    publish(walk, 7)
    walk.expect(not QueueProbe(walk.settings).exists(SUBSCRIPTION_QUEUE),
                "event 7 is not kept: the subscription's queue is gone")


def publish(walk: Walk, *events: int) -> None:
    for event in events:
        walk.mdb("send", TOPIC, f'{{"event": {event}}}', "--id", f"event-{event}")


def got(container: Container, who: str) -> list[str]:
    return [line.rsplit(" ", 1)[-1] for line in container.lines(f"{who} got event")]


if __name__ == "__main__":
    main(walk_through, __file__)
