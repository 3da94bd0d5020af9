"""Units of work in the test's process, on the embedded broker and SQLite (no ``mdb run``).

A container-managed unit commits the dedup row in the same transaction as the
handler's work, so a redelivery after the commit is recognised; an error the
handler does not catch rolls its work back and the message comes again.
"""

from __future__ import annotations

from mdbcontainer.testing import wait_for
from tests.apps import inproc
from tests.conftest import Backend
from tests.inprocess import attempts, effects, running, send


def test_a_container_managed_unit_commits_the_dedup_row_with_the_handlers_work(embedded: Backend) -> None:
    with running(embedded, transaction="container") as run:
        dedup = run.container.resources.dedup
        send(embedded, run, "once", n=1)
        wait_for(lambda: run.port.stats.handled == 1, what="the delivery handled")
        assert effects(embedded, "once") == 1
        assert dedup.seen("InProc", "once"), "the dedup row committed with the work"
        assert not dedup.seen("InProc", "never-sent")


def test_an_uncaught_error_rolls_the_units_work_back(embedded: Backend) -> None:
    inproc.FAIL_FIRST["rolled-back"] = 1
    with running(embedded, transaction="container") as run:
        dedup = run.container.resources.dedup
        send(embedded, run, "rolled-back", n=1)
        wait_for(lambda: run.port.stats.failed == 1, what="the first delivery failed")
        wait_for(lambda: run.port.stats.handled == 1, what="the redelivery handled")
        assert attempts("rolled-back") == [0, 1], "both deliveries wrote their row"
        assert effects(embedded, "rolled-back") == 1, "the failed delivery's row was rolled back"
        assert dedup.seen("InProc", "rolled-back")


def test_a_failed_unit_leaves_no_dedup_row(embedded: Backend) -> None:
    inproc.FAIL_FIRST["always"] = 1_000
    with running(embedded, transaction="container", backout_threshold=2) as run:
        dedup = run.container.resources.dedup
        send(embedded, run, "always", n=1)
        wait_for(lambda: run.port.stats.backed_out == 1, what="the message backed out")
        assert effects(embedded, "always") == 0
        assert not dedup.seen("InProc", "always"), "a rolled-back unit claims nothing"
