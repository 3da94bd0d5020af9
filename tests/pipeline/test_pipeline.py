"""The single-delivery pipeline in the test's process, on the embedded broker (no ``mdb run``).

What a port does with a delivery that fails: count it durably and requeue it,
and move it to the backout queue once it was delivered ``backout_threshold``
times, without the handler seeing it again.
"""

from __future__ import annotations

from mdbcontainer.pipeline.backout import REASON_THRESHOLD
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
