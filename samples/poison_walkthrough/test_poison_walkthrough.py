"""The poison walk-through's handler, tested in process with the test kit (no ``mdb run``).

``run.py`` shows the operator's side with ``mdb`` commands; this shows the
same rules in a test of a few lines: ``max_retries = 0`` stops the port at
the first failed delivery, and with ``max_retries >= backout_threshold`` the
poison message ends in the backout queue while the port runs on.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from mdbcontainer.testing import TestContainer

SETTINGS = Path(__file__).with_name("settings.toml")
PORT, QUEUE = "SamplePtoPListenerPort", "SamplePtoPQueue"


def test_an_order_is_processed() -> None:
    with TestContainer(SETTINGS) as mdb:
        mdb.send(QUEUE, {"order": 1}, message_id="order-1")
        mdb.drain()
        assert mdb.outcomes(PORT) == {"handled": 1}


def test_a_poison_message_stops_the_port_at_its_first_failed_delivery() -> None:
    with TestContainer(SETTINGS) as mdb:
        mdb.send(QUEUE, "not an order", message_id="poison")
        mdb.drain()
        state = mdb.port_state(PORT)
        assert state == "stopped" and "maximum retries (0) exceeded" in state.reason
        assert mdb.outcomes(PORT) == {"failed": 1}
        assert mdb.backed_out() == [], "it waits on its queue for the operator"


def test_with_max_retries_at_the_threshold_the_poison_message_is_backed_out() -> None:
    settings = tomllib.loads(SETTINGS.read_text())
    settings["ports"][PORT]["max_retries"] = 5
    settings["container"]["listeners"] = ["poison_listener"]
    with TestContainer(settings) as mdb:
        mdb.send(QUEUE, "not an order", message_id="poison")
        mdb.send(QUEUE, {"order": 2}, message_id="order-2")
        mdb.drain()
        assert mdb.outcomes(PORT) == {"failed": 5, "backed_out": 1, "handled": 1}
        [moved] = mdb.backed_out()
        assert (moved.id, moved.headers["x-mdb-redelivery-count"]) == ("poison", 5)
        assert mdb.port_state(PORT) == "started"
