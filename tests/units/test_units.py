"""Units of work in the test's process, on the public test kit (no ``mdb run``).

A container-managed unit commits the dedup row in the same transaction as the
handler's work, so a redelivery after the commit is recognised; an error the
handler does not catch rolls its work back and the message comes again.
"""

from __future__ import annotations

from mdbcontainer.testing import wait_for
from tests.apps import inproc
from tests.conftest import Backend
from tests.inprocess import attempts, effects, effects_in, running, running_on, send


def test_a_container_managed_unit_commits_the_dedup_row_with_the_handlers_work() -> None:
    with running(transaction="container") as mdb:
        dedup = mdb.container.resources.dedup
        mdb.send(mdb.queue, {"n": 1}, message_id="once")
        mdb.drain()
        assert mdb.outcomes("InProc") == {"handled": 1}
        assert effects(mdb, "once") == 1
        assert dedup.seen("InProc", "once"), "the dedup row committed with the work"
        assert not dedup.seen("InProc", "never-sent")


def test_an_uncaught_error_rolls_the_units_work_back() -> None:
    inproc.FAIL_FIRST["rolled-back"] = 1
    with running(transaction="container") as mdb:
        dedup = mdb.container.resources.dedup
        mdb.send(mdb.queue, {"n": 1}, message_id="rolled-back")
        mdb.drain()
        assert mdb.outcomes("InProc") == {"failed": 1, "handled": 1}
        assert attempts("rolled-back") == [0, 1], "both deliveries wrote their row"
        assert effects(mdb, "rolled-back") == 1, "the failed delivery's row was rolled back"
        assert dedup.seen("InProc", "rolled-back")


def test_a_failed_unit_leaves_no_dedup_row() -> None:
    inproc.FAIL_FIRST["always"] = 1_000
    with running(transaction="container", backout_threshold=2) as mdb:
        dedup = mdb.container.resources.dedup
        mdb.send(mdb.queue, {"n": 1}, message_id="always")
        mdb.drain()
        assert mdb.outcomes("InProc") == {"failed": 2, "backed_out": 1}
        assert effects(mdb, "always") == 0
        assert not dedup.seen("InProc", "always"), "a rolled-back unit claims nothing"


def test_a_bean_managed_transaction_commits_at_its_block_so_a_later_failure_keeps_the_work(
        embedded: Backend) -> None:
    """BMT: the handler's ``with ctx.transaction()`` is the unit; the redelivery finds it committed."""
    inproc.FAIL_FIRST["bean"] = 1
    with running_on(embedded, transaction="bean") as run:
        send(embedded, run, "bean", bean=True)
        wait_for(lambda: run.port.stats.duplicate_skipped == 1, what="the redelivery skipped")
        assert (run.port.stats.failed, run.port.stats.handled) == (1, 0)
        assert run.container.resources.dedup.seen("InProc", "bean")
        assert embedded.probe(run.settings).count(run.queue) == 0, "acknowledged, not run again"
    assert effects_in(embedded, "bean") == 1, "the failure after the block did not undo the work"
    assert attempts("bean") == [0], "the redelivery found the row before the handler (step 4)"
