"""Durable redelivery counts and the leases that tell a crash from a live loss (``state.counts``).

A failure is counted in the database before its message is requeued, so any
process reads it on the redelivery. A delivery nobody closed counts as a
failure only on the evidence of a death: a lease of its queue left open by a
holder that is gone. A graceful hand-back or a lost connection in a container
that lives on counts nothing.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable

import pytest
from sqlalchemy import update

from mdbcontainer.state.counts import CRASHED, Attempt, DeliveryCounter
from mdbcontainer.state.store import Store

Q = "ORDERS"


def test_a_failure_is_counted_durably_and_the_redelivery_reads_it(store: Store) -> None:
    counter = DeliveryCounter(store)
    assert counter.failures(Q, "m-1") == 0, "a first delivery writes nothing"
    assert counter.fail(Q, "m-1", "ValueError: boom") == 1
    elsewhere = DeliveryCounter(store)  # another consumer, another process: the same table
    assert elsewhere.open(Q, "m-1") == Attempt(1, "ValueError: boom")
    assert elsewhere.fail(Q, "m-1", "KeyError: again") == 2
    assert counter.open(Q, "m-1") == Attempt(2, "KeyError: again")
    assert counter.failures(Q, "m-2") == 0 and counter.failures("OTHER", "m-1") == 0, "keyed by queue and id"


def test_two_copies_failing_at_once_both_count(store: Store) -> None:
    """A producer's retry or a copy back from a wait beside its original: the count returned is the total."""
    counter = DeliveryCounter(store)
    first, second = counter.fail(Q, "m-1", "one"), counter.fail(Q, "m-1", "two")
    assert (first, second) == (1, 2)


def test_a_replay_starts_the_count_again(store: Store) -> None:
    counter = DeliveryCounter(store)
    counter.fail(Q, "m-1", "boom")
    counter.reset(Q, "m-1")
    assert counter.failures(Q, "m-1") == 0
    assert counter.open(Q, "m-1") == Attempt(0, None)


def _handed_back(old: DeliveryCounter) -> None:
    old.hand_back(Q, ["m-1"])


def _stopped(old: DeliveryCounter) -> None:
    old.end_leases_of("c-old")


def _crashed(old: DeliveryCounter) -> None:
    pass  # the process died: its lease stays open


@pytest.mark.parametrize(("end", "failures"), [(_crashed, 1), (_handed_back, 0), (_stopped, 0)],
                         ids=["crashed", "handed-back", "stopped"])
def test_an_unclosed_delivery_counts_only_when_its_container_died(
        store: Store, end: Callable[[DeliveryCounter], None], failures: int) -> None:
    """A restarted container that got its pid back (pid 1 in a pod) tells the old lease by its container id."""
    old = DeliveryCounter(store)
    old.begin_lease(Q, "c-old")
    assert old.open(Q, "m-1") == Attempt(0, None), "its first delivery, never closed: the old one is alive"
    end(old)
    new = DeliveryCounter(store)
    new.begin_lease(Q, "c-new")
    attempt = new.open(Q, "m-1")
    assert attempt.count == failures
    assert attempt.last_exception == (CRASHED if failures else None)
    assert new.failures(Q, "m-1") == failures, "the crash is written, not only returned"


def test_a_lost_connection_in_a_living_container_counts_nothing(store: Store) -> None:
    counter = DeliveryCounter(store)
    lease = counter.begin_lease(Q, "c-1")
    counter.end_lease(lease)  # a broker restart: the channel's deliveries come back
    assert counter.open(Q, "m-1") == Attempt(0, None)


def _dead_pid() -> int:
    done = subprocess.Popen(["true"])
    done.wait()
    return done.pid


def test_a_lease_whose_process_is_gone_is_the_evidence_for_every_delivery_of_its_queue(store: Store) -> None:
    """A process killed with first deliveries in flight (never recorded): each of them counts."""
    gone = DeliveryCounter(store)
    lease = gone.begin_lease(Q, "c-gone")
    t = store.tables.lease
    with store.engine.begin() as conn:  # as a process that has exited left it
        conn.execute(update(t).where(t.c.id == lease).values(pid=_dead_pid()))
    survivor = DeliveryCounter(store)
    survivor.begin_lease(Q, "c-live")
    assert survivor.open(Q, "m-1") == Attempt(1, CRASHED)
    assert survivor.open(Q, "m-2") == Attempt(1, CRASHED), "the lease found dead stays the evidence"
    assert survivor.open("OTHER", "m-3") == Attempt(0, None), "a death on one queue says nothing of another"


def test_a_lease_of_a_process_that_runs_on_this_host_is_no_death(store: Store) -> None:
    counter = DeliveryCounter(store)
    lease = counter.begin_lease(Q, "c-other")
    t = store.tables.lease
    with store.engine.begin() as conn:  # another container of this host: a process that runs
        conn.execute(update(t).where(t.c.id == lease).values(pid=1))
    counter.open(Q, "m-1")
    other = DeliveryCounter(store)
    other.begin_lease(Q, "c-mine")
    assert other.open(Q, "m-1") == Attempt(0, None), "a competing consumer wins no race"
