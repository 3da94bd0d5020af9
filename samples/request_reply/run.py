"""Step by step (README: JMS reliability mechanisms): request/reply with a temporary reply queue.

Run it: ``python samples/request_reply/run.py`` (``--keep`` keeps the scratch directory).

1. ``Producer.request`` sends with ``reply_to`` naming a temporary queue of
   its own (exclusive, deleted with its connection, as a JMS TemporaryQueue)
   and waits for the reply with the same correlation id.
2. ``mdb request`` does the same from a shell and prints the reply's body.
3. A request nobody answers ends with ``RequestTimeout`` (and ``mdb request``
   with exit 1 and one line), never with a hang.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _support import Walk, main

from mdbcontainer import Producer
from mdbcontainer.errors import RequestTimeout, Unroutable

PORT = "PriceService"


def walk_through(walk: Walk) -> None:
    walk.say("Start the container with the price service")
    container = walk.start()
    container.wait_started(PORT)

    walk.say("Ask for a price from Python: Producer.request")
    with Producer.from_settings(walk.settings) as producer:
        reply = producer.request("PRICES", {"sku": "A-1"}, timeout="10s", correlation_id="ask-1")
        walk.note(f"reply {reply.body} (correlation id {reply.correlation_id}, "
                  f"came back on {reply.destination})")
        walk.expect(reply.body == {"sku": "A-1", "price": "9.99"} and reply.correlation_id == "ask-1",
                    "the reply answers this request")
        unknown = producer.request("PRICES", {"sku": "Z-9"}, timeout="10s")
        walk.note(f"reply {unknown.body}")

    walk.say("Ask from a shell: mdb request")
    result = walk.mdb("request", "PRICES", '{"sku": "B-2"}', "--timeout", "10s")
    walk.expect(json.loads(result.stdout) == {"sku": "B-2", "price": "24.50"}, "the reply's body on stdout")

    walk.say("Ask a queue nobody serves: a timeout, not a hang")
    with Producer.from_settings(walk.settings) as producer:
        try:
            producer.request("NOBODY.LISTENS", {"sku": "A-1"}, timeout="1s")
        except RequestTimeout as exc:
            walk.note(f"RequestTimeout: {exc}")
        else:
            walk.expect(False, "a request nobody answers times out")
    result = walk.mdb("request", "NOBODY.LISTENS", '{"sku": "A-1"}', "--timeout", "1s", check=False)
    walk.expect(result.returncode == 1, "mdb request exits 1 with one line")

    walk.say("Ask a queue that does not exist (a typo): refused at once, nothing sent or created")
    with Producer.from_settings(walk.settings) as producer:
        try:
            producer.request("PRICE", {"sku": "A-1"}, timeout="10s")
        except Unroutable as exc:
            walk.note(f"Unroutable: {exc}")
        else:
            walk.expect(False, "a request to a queue that does not exist is refused")
    walk.expect(container.terminate() == 0, "SIGTERM: the container stops cleanly")


if __name__ == "__main__":
    main(walk_through, __file__)
