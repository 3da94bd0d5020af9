"""What a unit of work sends and moves (``ctx.send``, ``ctx.move_to``), in the test's process.

In a container-managed unit a send is an outbox row of the transaction: a
unit that rolls back sends nothing, and the redelivery that commits sends it
once. Without a transaction a send goes out at once. A move is part of the
unit: the message lands on the other queue with its reason and counts as
handled, its dedup row committed.
"""

from __future__ import annotations

import json

from mdbcontainer.testing import wait_for
from mdbcontainer.wire.headers import BACKOUT_REASON, ORIGINAL_DESTINATION
from tests.apps import inproc
from tests.conftest import Backend
from tests.inprocess import attempts, running_on, send


def test_a_send_of_a_rolled_back_unit_never_leaves_and_the_committed_one_leaves_once(
        embedded: Backend) -> None:
    inproc.FAIL_FIRST["sends"] = 1
    down = embedded.q("DOWN")
    with running_on(embedded, transaction="container", queues={down: {}}) as run:
        send(embedded, run, "sends", send=down)
        wait_for(lambda: run.port.stats.handled == 1, what="the redelivery handled")
        probe = embedded.probe(run.settings)
        wait_for(lambda: probe.count(down) == 1, what="the send published")
        assert run.container.resources.outbox.backlog() == 0, "its row deleted once published"
        [sent] = probe.take_all(down)
    assert attempts("sends") == [0, 1], "the first unit sent too, then rolled back"
    assert json.loads(sent.body) == {"from": "sends"}


def test_a_send_without_a_transaction_goes_out_at_once(embedded: Backend) -> None:
    down = embedded.q("DOWN")
    with running_on(embedded, transaction="none", queues={down: {}}) as run:
        send(embedded, run, "direct", send=down)
        wait_for(lambda: run.port.stats.handled == 1, what="handled")
        probe = embedded.probe(run.settings)
        wait_for(lambda: probe.count(down) == 1, what="the send published")
        assert run.container.resources.outbox.backlog() == 0, "no outbox row without a transaction"


def test_a_move_lands_with_its_reason_and_counts_as_handled(embedded: Backend) -> None:
    review = embedded.q("REVIEW")
    with running_on(embedded, transaction="container", queues={review: {}}) as run:
        send(embedded, run, "moved", move_to=review)
        wait_for(lambda: run.port.stats.handled == 1, what="the move handled")
        [moved] = embedded.probe(run.settings).take_all(review)
        dedup = run.container.resources.dedup
        assert dedup.seen("InProc", "moved"), "the move committed with the unit"
    assert moved.headers[BACKOUT_REASON] == "needs-review"
    assert moved.headers[ORIGINAL_DESTINATION] == run.queue
    assert (run.port.stats.backed_out, run.port.stats.failed) == (0, 0)
