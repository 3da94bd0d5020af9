"""The single-delivery pipeline in the test's process, on the embedded broker (no ``mdb run``).

What a port does with a delivery that fails: count it durably and requeue it,
and move it to the backout queue once it was delivered ``backout_threshold``
times, without the handler seeing it again.
"""

from __future__ import annotations

from mdbcontainer.pipeline.backout import REASON_INVALID, REASON_THRESHOLD
from mdbcontainer.testing import wait_for
from tests.apps import inproc
from tests.conftest import Backend
from tests.inprocess import attempts, running, send


def test_a_failed_delivery_is_counted_and_requeued_then_handled(embedded: Backend) -> None:
    inproc.FAIL_FIRST["fails-once"] = 1
    with running(embedded, transaction="none") as run:
        send(embedded, run, "fails-once", n=1)
        wait_for(lambda: run.port.stats.handled == 1, what="the second delivery handled")
        assert attempts("fails-once") == [0, 1], "requeued, and the handler saw the durable count"
        assert (run.port.stats.failed, run.port.stats.backed_out) == (1, 0)
        assert embedded.probe(run.settings).count(run.queue) == 0
        assert embedded.probe(run.settings).count(embedded.q("DLQ")) == 0


def test_a_message_delivered_backout_threshold_times_is_backed_out(embedded: Backend) -> None:
    inproc.FAIL_FIRST["poison"] = 1_000
    with running(embedded, transaction="none", backout_threshold=2) as run:
        send(embedded, run, "poison", n=1)
        wait_for(lambda: run.port.stats.backed_out == 1, what="the message backed out")
        [moved] = embedded.probe(run.settings).take_all(embedded.q("DLQ"))
    assert moved.message_id == "poison"
    assert moved.headers["x-mdb-backout-reason"] == REASON_THRESHOLD
    assert attempts("poison") == [0, 1], "the third delivery never reached the handler"
    assert run.port.stats.failed == 2


# A first delivery (not redelivered, no expiry, an id) on a `transaction = "none"` port with
# `acknowledge = "auto"` takes the pipeline's flat path (Pipeline._first): its failures must still
# be counted durably, backed out, and stop the port as every other delivery's are.


def test_a_handled_first_delivery_is_counted_timed_and_its_latency_observed(embedded: Backend) -> None:
    with running(embedded, transaction="none") as run:
        send(embedded, run, "fine", n=1)
        wait_for(lambda: run.port.stats.handled == 1, what="the first delivery handled")
        [tally] = run.port.tallies
        assert (tally.handler.count, tally.latency.count) == (1, 1), "handler time and end-to-end"
        assert tally.latency.sum >= 0.0 and 0.0 <= tally.handler.sum < 5.0
        assert embedded.probe(run.settings).count(run.queue) == 0, "acknowledged"
    assert attempts("fine") == [0]


def test_a_failing_first_delivery_is_counted_durably_then_backed_out_at_threshold_one(
        embedded: Backend) -> None:
    inproc.FAIL_FIRST["poison-first"] = 1_000
    with running(embedded, transaction="none", backout_threshold=1) as run:
        send(embedded, run, "poison-first", n=1)
        wait_for(lambda: run.port.stats.backed_out == 1, what="the message backed out")
        assert run.port.counter.failures(run.queue, "poison-first") == 1, "counted in the database"
        [moved] = embedded.probe(run.settings).take_all(embedded.q("DLQ"))
        assert run.port.state == "started" and run.port.consecutive_failures == 0
    assert moved.message_id == "poison-first"
    assert moved.headers["x-mdb-backout-reason"] == REASON_THRESHOLD
    assert "scripted failure" in moved.headers["x-mdb-exception"]
    assert attempts("poison-first") == [0]
    assert (run.port.stats.failed, run.port.stats.handled) == (1, 0)


def test_a_failing_first_delivery_past_max_retries_stops_the_port_and_stays_queued(
        embedded: Backend) -> None:
    inproc.FAIL_FIRST["stops-port"] = 1_000
    with running(embedded, transaction="none", max_retries=0) as run:
        send(embedded, run, "stops-port", n=1)
        wait_for(lambda: run.port.state == "stopped", what="the port stopped")
        assert run.port.counter.failures(run.queue, "stops-port") == 1, "counted before the requeue"
        wait_for(lambda: embedded.probe(run.settings).count(run.queue) == 1, what="the message requeued")
    assert attempts("stops-port") == [0]
    assert run.port.stats.failed == 1


def test_a_first_delivery_the_port_does_not_accept_is_backed_out_as_an_invalid_body(
        embedded: Backend) -> None:
    with running(embedded, transaction="none") as run:
        with embedded.producer(run.settings) as producer:
            producer.send(run.queue, "<n>1</n>", message_id="xml", content_type="application/xml")
        wait_for(lambda: run.port.stats.invalid_body == 1, what="the body backed out")
        [moved] = embedded.probe(run.settings).take_all(embedded.q("DLQ"))
    assert moved.headers["x-mdb-backout-reason"] == REASON_INVALID
    assert attempts("xml") == [], "the handler never saw it"
    assert (run.port.stats.failed, run.port.stats.backed_out) == (0, 0)
