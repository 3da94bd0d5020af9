"""``mdb dlq replay`` in the test's process, on the embedded broker and SQLite.

A message the handler moved (``ctx.move_to``) committed its dedup row; its
replay forgets that row once, so the copy is handled again, and a replay of the
same move run again (the first was interrupted before it acknowledged the
original) leaves the row that the first copy committed since.
"""

from __future__ import annotations

from sqlalchemy import insert

from mdbcontainer.operations.dlq import replay, replay_recorded
from mdbcontainer.state.dedup import Dedup
from mdbcontainer.state.store import Store, utcnow
from tests.conftest import Backend

MOVED = {"x-mdb-port": "Work", "x-mdb-backout-reason": "moved by the handler"}


def _park(backend: Backend, settings: object, queue: str, failed_at: str) -> None:
    """The message ``m`` on the DLQ as the handler's ``ctx.move_to`` left it."""
    with backend.producer(settings) as producer:  # type: ignore[arg-type]
        producer.send(backend.q("DLQ"), {"n": 1}, message_id="m", headers={
            **MOVED, "x-mdb-original-destination": queue, "x-mdb-failed-at": failed_at})


def test_a_replay_of_one_move_forgets_the_dedup_row_once_however_often_it_runs(embedded: Backend) -> None:
    queue = embedded.q("IN")
    path = embedded.write(ports={"Work": {"destination": queue}})
    settings = embedded.settings(path)
    store = Store(settings.container)
    store.create_tables()
    dedup = Dedup(store)

    def handled() -> None:  # the row a handling of ``m`` commits
        with store.engine.begin() as conn:
            conn.execute(insert(store.tables.dedup).values(port="Work", message_id="m",
                                                           processed_at=utcnow()))

    try:
        handled()
        _park(embedded, path, queue, "2026-12-01T10:00:00+00:00")
        assert replay(settings, ["m"]).replayed == 1
        assert not dedup.seen("Work", "m"), "the replay forgot the row: the copy is handled again"
        handled()  # the copy was handled; the original was not acknowledged (the replay was killed)
        _park(embedded, path, queue, "2026-12-01T10:00:00+00:00")
        assert replay(settings, ["m"]).replayed == 1
        assert dedup.seen("Work", "m"), "run again, the replay keeps the row: the copy is a duplicate"
        _park(embedded, path, queue, "2026-12-01T11:00:00+00:00")  # moved again, later
        assert replay(settings, ["m"]).replayed == 1
        assert not dedup.seen("Work", "m"), "a replay of a later move forgets the row again"
    finally:
        store.dispose()


def test_a_replay_that_raises_is_recorded_with_what_it_did(embedded: Backend) -> None:
    queue = embedded.q("IN")
    path = embedded.write(ports={"Work": {"destination": queue}})
    settings = embedded.settings(path)
    written: list[tuple[str, str]] = []
    try:
        replay_recorded(settings, [], True, embedded.q("NO-SUCH-QUEUE"), None,
                        record=lambda target, detail: written.append((target, detail)))
    except Exception as exc:
        assert "does not exist" in str(exc)
    else:
        raise AssertionError("a replay from a queue that does not exist raises")
    ((target, detail),) = written
    assert target == embedded.q("NO-SUCH-QUEUE")
    assert detail.startswith("replayed 0 message(s) (all); stopped: DlqError: ") and "does not exist" in detail
