"""``TestContainer`` (mdbcontainer/testing/kit.py): each method, each outcome, the clock, the crashes.

Every test runs on the embedded broker and on RabbitMQ (the ``backend``
fixture); the container's database is the kit's own SQLite in a temporary
folder. Queue and topic names are unique per test, so tests on the shared
RabbitMQ never see each other's messages.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import func, select

from mdbcontainer.testing import TestContainer
from mdbcontainer.wire.delays import wait_queues
from mdbcontainer.wire.headers import REASON_INVALID, REASON_THRESHOLD
from tests.apps import kit as app
from tests.conftest import Backend

Kit = Callable[..., TestContainer]


@pytest.fixture(autouse=True)
def fresh_calls() -> None:
    """The handlers' record of calls is per test (the same ids run on both brokers)."""
    app.CALLS.clear()


@pytest.fixture
def kit(backend: Backend) -> Iterator[Kit]:
    """A TestContainer factory: port KitOrders (and the others asked for) on this test's queues.

    The redelivery wait queues the containers declared are deleted with the test's own queues."""
    made: list[TestContainer] = []

    def make(*, queue: dict[str, Any] | None = None, port: dict[str, Any] | None = None,
             ports: dict[str, dict[str, Any]] | None = None) -> TestContainer:
        orders, events = backend.q("ORDERS"), backend.q("kit.events")
        backend.events = events  # type: ignore[attr-defined]
        settings = {
            "container": {"listeners": ["tests.apps.kit"], "metadata": "tests.apps.kit:Base",
                          "dead_letter_queue": backend.q("DLQ")},
            "queues": {orders: {"backout_threshold": 3, **(queue or {})}},
            "topics": {events: {}},
            "ports": {"KitOrders": {"destination": orders, "max_retries": 10, **(port or {})},
                      **{name: {**p, "destination": p.get("destination", backend.q(name))}
                         for name, p in (ports or {}).items()}},
        }
        broker = backend.broker_url if backend.kind == "rabbitmq" else None
        made.append(TestContainer(settings, ports=list(settings["ports"]), broker_url=broker))
        return made[-1]

    yield make
    for mdb in made:
        if mdb.settings is not None:
            for name in mdb.settings.queues:
                backend.queues.update(wait_queues(name, mdb.settings.queue(name)))


def order(backend: Backend, order_id: int, **extra: Any) -> dict[str, Any]:
    return {"order_id": order_id, "amount": "9.99", "events": backend.events, **extra}  # type: ignore[attr-defined]


def orders_of(mdb: TestContainer, order_id: int) -> int:
    with mdb.session() as session:
        return int(session.scalar(select(func.count()).select_from(app.Order).where(app.Order.id == order_id))
                   or 0)


def queue_of(mdb: TestContainer, port: str = "KitOrders") -> str:
    return mdb.container.ports[port].queue


# -- each method, each outcome ------------------------------------------------


def test_an_order_is_handled_once_and_its_duplicate_skipped(kit: Kit, backend: Backend) -> None:
    with kit() as mdb:
        first = mdb.send(queue_of(mdb), order(backend, 1), message_id="o-1")
        mdb.send(queue_of(mdb), order(backend, 1), message_id="o-1")
        mdb.drain()
        assert first == "o-1"
        assert mdb.outcomes("KitOrders") == {"handled": 1, "duplicate_skipped": 1}
        assert [m.body for m in mdb.sent(backend.events)] == [{"order_id": 1, "event": "placed"}]  # type: ignore[attr-defined]
        assert [m.id for m in mdb.sent(backend.events)] == ["o-1.placed"], "kept between calls"  # type: ignore[attr-defined]
        assert mdb.backed_out() == []
        assert orders_of(mdb, 1) == 1
        assert mdb.port_state("KitOrders") == "started"


def test_a_body_that_fails_validation_is_backed_out_as_invalid(kit: Kit, backend: Backend) -> None:
    with kit() as mdb:
        mdb.send(queue_of(mdb), {"order_id": "x"}, message_id="bad")
        mdb.drain()
        assert mdb.outcomes("KitOrders") == {"invalid_body": 1}
        [moved] = mdb.backed_out()
        assert (moved.id, moved.body) == ("bad", {"order_id": "x"})
        assert moved.headers["x-mdb-backout-reason"] == REASON_INVALID
        assert "order_id" in moved.headers["x-mdb-exception"]
    assert app.calls("bad") == []


def test_a_poison_message_is_backed_out_at_the_threshold_with_its_traceback(kit: Kit, backend: Backend) -> None:
    with kit() as mdb:
        mdb.send(queue_of(mdb), order(backend, 2, fail=99), message_id="poison")
        mdb.drain()
        assert mdb.outcomes("KitOrders") == {"failed": 3, "backed_out": 1}
        [moved] = mdb.backed_out()
        assert moved.headers["x-mdb-backout-reason"] == REASON_THRESHOLD
        assert moved.headers["x-mdb-redelivery-count"] == 3
        assert mdb.port_state("KitOrders") == "started"
        assert orders_of(mdb, 2) == 0
        report = mdb.failures.report()
    assert app.calls("poison") == [0, 1, 2]
    assert "message poison on port KitOrders" in report
    assert "Traceback" in report and "ValueError: amount 9.99 refused (delivery 2)" in report
    assert [f.outcome for f in mdb.failures.of("poison")] == ["failed", "failed", "failed", "backed_out"]


def test_the_port_stops_after_maximum_retries_and_the_message_stays(kit: Kit, backend: Backend) -> None:
    with kit(port={"max_retries": 1}) as mdb:
        mdb.send(queue_of(mdb), order(backend, 3, fail=99), message_id="stops")
        mdb.drain()
        state = mdb.port_state("KitOrders")
        assert state == "stopped"
        assert "maximum retries (1) exceeded" in state.reason and "stops" in state.reason
        assert mdb.outcomes("KitOrders") == {"failed": 2}
        assert mdb.backed_out() == []
        assert "port_stopped" in mdb.failures.report()


def test_a_message_that_expires_while_it_waits_comes_back_expired(kit: Kit, backend: Backend) -> None:
    with kit(queue={"redelivery_delay": "5s"}) as mdb:
        mdb.send(queue_of(mdb), order(backend, 4, fail=99), message_id="late", ttl="2s")
        mdb.drain()
        assert mdb.outcomes("KitOrders") == {"failed": 1}, "waiting out its delay"
        mdb.advance("10s")
        mdb.drain()
        assert mdb.outcomes("KitOrders") == {"failed": 1, "expired": 1}
    assert app.calls("late") == [0]


def test_drain_names_the_messages_and_ports_still_busy(kit: Kit, backend: Backend) -> None:
    app.RELEASE.clear()
    with kit() as mdb:
        mdb.send(queue_of(mdb), order(backend, 5, hold=True), message_id="slow")
        try:
            with pytest.raises(AssertionError, match=r"port KitOrders: .*in a handler: slow"):
                mdb.drain(timeout="300ms")
        finally:
            app.RELEASE.set()
        mdb.drain()
        assert mdb.outcomes("KitOrders") == {"handled": 1}


def test_sent_refuses_a_queue_a_port_reads_and_reads_one_nobody_does(kit: Kit, backend: Backend) -> None:
    with kit(ports={"KitPlain": {}}) as mdb:
        with pytest.raises(ValueError, match="read by port KitOrders"):
            mdb.sent(queue_of(mdb))
        with pytest.raises(KeyError, match="no port 'Nope'"):
            mdb.outcomes("Nope")
        with pytest.raises(ValueError, match="not a crash point"):
            mdb.crash(at="mid-replay")
        assert mdb.sent(backend.q("NOBODY")) == []


# -- the clock ----------------------------------------------------------------


def test_advance_runs_a_backoff_of_10s_20s_40s_without_sleeping(kit: Kit, backend: Backend) -> None:
    # Waits of seconds, not of a second: the clock is the wall's plus what advance added, and on a
    # loaded machine the wall alone can take half a second between a failure and the check.
    delays = {"redelivery_delay": "10s", "redelivery_backoff": 2, "backout_threshold": 5}
    with kit(queue=delays) as mdb:
        began = time.monotonic()
        mdb.send(queue_of(mdb), order(backend, 6, fail=3), message_id="backoff")
        mdb.drain()
        assert app.calls("backoff") == [0]
        mdb.advance("5s")
        mdb.drain()
        assert app.calls("backoff") == [0], "half the first wait is not the wait"
        for step, wait in enumerate(("5s", "20s", "40s"), start=1):
            mdb.advance(wait)
            mdb.drain()
            assert app.calls("backoff") == list(range(step + 1)), f"after {wait}"
        elapsed = time.monotonic() - began
        assert mdb.outcomes("KitOrders") == {"failed": 3, "handled": 1}
        assert orders_of(mdb, 6) == 1
    assert elapsed < 9.0, f"70s of waits took {elapsed:.1f}s: the clock did not move them"


def test_advance_ends_a_batchs_linger_without_waiting_for_it(kit: Kit, backend: Backend) -> None:
    with kit(ports={"KitBatch": {"batch_size": 3, "batch_linger": "10s"}}) as mdb:
        mdb.send(queue_of(mdb, "KitBatch"), order(backend, 20), message_id="lingers")
        with pytest.raises(AssertionError, match="port KitBatch"):
            mdb.drain(timeout="300ms")  # one order of three: the batch waits for more
        assert app.calls("lingers") == []
        began = time.monotonic()
        mdb.advance("10s")
        mdb.drain()
        assert time.monotonic() - began < 5.0
        assert mdb.outcomes("KitBatch") == {"handled": 1}
        assert orders_of(mdb, 20) == 1


# -- crashes ------------------------------------------------------------------

# point -> (port, how the messages behave, what the port counts once everything settled)
SINGLE_POINTS = ("before-handler", "in-handler", "after-commit", "after-ack", "outbox-dispatch")


@pytest.mark.parametrize("point", SINGLE_POINTS)
def test_a_crash_on_the_way_of_a_delivery_applies_it_once(kit: Kit, backend: Backend, point: str) -> None:
    with kit() as mdb:
        mdb.crash(at=point)
        mdb.send(queue_of(mdb), order(backend, 7), message_id=f"crash-{point}")
        mdb.drain()
        assert orders_of(mdb, 7) == 1, "the order committed exactly once"
        events = {m.id for m in mdb.sent(backend.events)}  # type: ignore[attr-defined]
        assert events == {f"crash-{point}.placed"}, "its event sent (at least once, one id)"
        outcomes = mdb.outcomes("KitOrders")
        assert mdb.backed_out() == []
    calls = app.calls(f"crash-{point}")
    if point == "after-commit" or point == "outbox-dispatch":
        assert calls == [0] and outcomes == {"duplicate_skipped": 1}, "redelivered, the dedup skipped it"
    elif point == "after-ack":  # a once-only port's acknowledgment leaves after the outcome counts
        assert calls == [0] and outcomes == {"handled": 1}, "acknowledged before the crash: nothing comes back"
    else:  # the killed delivery counts as a failed one
        assert outcomes == {"handled": 1}
        assert calls == ([1] if point == "before-handler" else [0, 1])


def test_a_crash_in_the_middle_of_a_backout_leaves_the_message_backed_out(kit: Kit, backend: Backend) -> None:
    with kit(queue={"backout_threshold": 1}) as mdb:
        mdb.crash(at="mid-backout")
        mdb.send(queue_of(mdb), order(backend, 8, fail=99), message_id="mid-backout")
        mdb.drain()
        moved = mdb.backed_out()
        assert {m.id for m in moved} == {"mid-backout"} and len(moved) in (1, 2), "at least once, never lost"
        assert orders_of(mdb, 8) == 0
        assert mdb.container.resources.counter.failures(queue_of(mdb), "mid-backout") >= 1


@pytest.mark.parametrize("point", ["before-wait", "mid-wait"])
def test_a_crash_on_the_way_to_a_redelivery_delay_applies_the_message_once(
        kit: Kit, backend: Backend, point: str) -> None:
    with kit(queue={"redelivery_delay": "1s"}) as mdb:
        mdb.crash(at=point)
        mdb.send(queue_of(mdb), order(backend, 9, fail=1), message_id=point)
        mdb.drain()
        mdb.advance("2s")  # a copy that reached its wait queue comes back: skipped, never applied again
        mdb.drain()
        assert orders_of(mdb, 9) == 1
        outcomes = mdb.outcomes("KitOrders")
        assert outcomes["handled"] == 1 and outcomes["failed"] == 1
        assert outcomes.get("duplicate_skipped", 0) == (1 if point == "mid-wait" else 0)


@pytest.mark.parametrize("point", ["before-commit", "after-commit", "mid-acks"])
def test_a_crash_in_a_batch_applies_every_message_once(kit: Kit, backend: Backend, point: str) -> None:
    batch = {"KitBatch": {"batch_size": 3, "batch_linger": "1s"}}
    with kit(ports=batch) as mdb:
        queue = queue_of(mdb, "KitBatch")
        mdb.crash(at=point, port="KitBatch")
        for n in (10, 11, 12):
            mdb.send(queue, order(backend, n), message_id=f"{point}-{n}")
        mdb.drain()
        assert [orders_of(mdb, n) for n in (10, 11, 12)] == [1, 1, 1]
        assert mdb.backed_out() == []
        outcomes = mdb.outcomes("KitBatch")
    assert outcomes.get("handled", 0) + outcomes.get("duplicate_skipped", 0) >= 3
