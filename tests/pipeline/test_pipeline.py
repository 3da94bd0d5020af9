"""The single-delivery pipeline in the test's process, on the public test kit (no ``mdb run``).

What a port does with a delivery that fails: count it durably and requeue it,
and move it to the backout queue once it was delivered ``backout_threshold``
times, without the handler seeing it again. ``tests/inprocess.py``
runs port InProc (tests/apps/inproc.py) in a ``TestContainer``.
"""

from __future__ import annotations

from mdbcontainer.testing import QueueProbe
from mdbcontainer.wire.headers import REASON_INVALID, REASON_THRESHOLD
from tests.apps import inproc
from tests.inprocess import attempts, running


def test_a_failed_delivery_is_counted_and_requeued_then_handled() -> None:
    inproc.FAIL_FIRST["fails-once"] = 1
    with running(transaction="none") as mdb:
        mdb.send(mdb.queue, {"n": 1}, message_id="fails-once")
        mdb.drain()
        assert attempts("fails-once") == [0, 1], "requeued, and the handler saw the durable count"
        assert mdb.outcomes("InProc") == {"failed": 1, "handled": 1}
        assert mdb.backed_out() == []


def test_a_message_delivered_backout_threshold_times_is_backed_out() -> None:
    inproc.FAIL_FIRST["poison"] = 1_000
    with running(transaction="none", backout_threshold=2) as mdb:
        mdb.send(mdb.queue, {"n": 1}, message_id="poison")
        mdb.drain()
        [moved] = mdb.backed_out()
        assert mdb.outcomes("InProc") == {"failed": 2, "backed_out": 1}
    assert moved.id == "poison"
    assert moved.headers["x-mdb-backout-reason"] == REASON_THRESHOLD
    assert attempts("poison") == [0, 1], "the third delivery never reached the handler"


# A first delivery (not redelivered, no expiry, an id) on a `transaction = "none"` port with
# `acknowledge = "auto"` takes the pipeline's flat path (Pipeline._first): its failures must still
# be counted durably, backed out, and stop the port as every other delivery's are.


def test_a_handled_first_delivery_is_counted_timed_and_its_latency_observed() -> None:
    with running(transaction="none") as mdb:
        mdb.send(mdb.queue, {"n": 1}, message_id="fine")
        mdb.drain()
        assert mdb.outcomes("InProc") == {"handled": 1}
        [tally] = mdb.container.ports["InProc"].tallies
        assert (tally.handler.count, tally.latency.count) == (1, 1), "handler time and end-to-end"
        assert tally.latency.sum >= 0.0 and 0.0 <= tally.handler.sum < 5.0
    assert attempts("fine") == [0]


def test_a_failing_first_delivery_is_counted_durably_then_backed_out_at_threshold_one() -> None:
    inproc.FAIL_FIRST["poison-first"] = 1_000
    with running(transaction="none", backout_threshold=1) as mdb:
        mdb.send(mdb.queue, {"n": 1}, message_id="poison-first")
        mdb.drain()
        port = mdb.container.ports["InProc"]
        assert port.counter.failures(mdb.queue, "poison-first") == 1, "counted in the database"
        [moved] = mdb.backed_out()
        assert mdb.port_state("InProc") == "started" and port.consecutive_failures == 0
        assert mdb.outcomes("InProc") == {"failed": 1, "backed_out": 1}
    assert moved.id == "poison-first"
    assert moved.headers["x-mdb-backout-reason"] == REASON_THRESHOLD
    assert "scripted failure" in moved.headers["x-mdb-exception"]
    assert attempts("poison-first") == [0]


def test_a_failing_first_delivery_past_max_retries_stops_the_port_and_stays_queued() -> None:
    inproc.FAIL_FIRST["stops-port"] = 1_000
    with running(transaction="none", max_retries=0) as mdb:
        mdb.send(mdb.queue, {"n": 1}, message_id="stops-port")
        mdb.drain()
        assert mdb.port_state("InProc") == "stopped"
        assert mdb.container.ports["InProc"].counter.failures(mdb.queue, "stops-port") == 1, \
            "counted before the requeue"
        assert QueueProbe(mdb.settings).count(mdb.queue) == 1, "the message requeued"
        assert mdb.outcomes("InProc") == {"failed": 1}
    assert attempts("stops-port") == [0]


def test_a_first_delivery_the_port_does_not_accept_is_backed_out_as_an_invalid_body() -> None:
    with running(transaction="none") as mdb:
        mdb.send(mdb.queue, "<n>1</n>", message_id="xml", content_type="application/xml")
        mdb.drain()
        [moved] = mdb.backed_out()
        assert mdb.outcomes("InProc") == {"invalid_body": 1}
    assert moved.headers["x-mdb-backout-reason"] == REASON_INVALID
    assert attempts("xml") == [], "the handler never saw it"
