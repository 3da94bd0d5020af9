"""state/counts.py in process: when an unclosed earlier delivery is charged as a crash.

A lease is the evidence of a death only while its dead holder's deliveries
can still be coming back: from the holder's last sign of life (its
container's heartbeat) until DEATH_EVIDENCE after the queue's next consumer
could receive them. Each test takes well under a second on SQLite.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from mdbcontainer.settings import settings_from_dict
from mdbcontainer.state.counts import CRASHED, DeliveryCounter
from mdbcontainer.state.store import Store, utcnow


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    settings = settings_from_dict({"container": {"database_url": f"sqlite:///{tmp_path}/c.db"}})
    made = Store(settings.container)
    made.create_tables()
    yield made
    made.engine.dispose()


def dead_pid() -> int:
    """The pid of a process of this host that ran and is gone."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    return gone.pid


def container_row(store: Store, container: str, heartbeat_at: datetime, host: str | None = None) -> None:
    with store.engine.begin() as conn:
        conn.execute(store.tables.container.insert().values(
            id=container, host=host or socket.gethostname(), pid=0, started_at=heartbeat_at,
            heartbeat_at=heartbeat_at, stopped=False, stats="[]"))


def lease_row(store: Store, container: str, pid: int, started_at: datetime, *, queue: str = "q",
              host: str | None = None) -> str:
    lease = uuid.uuid4().hex
    with store.engine.begin() as conn:
        conn.execute(store.tables.lease.insert().values(
            id=lease, queue=queue, container=container, host=host or socket.gethostname(), pid=pid,
            started_at=started_at, ended_at=None, died=False))
    return lease


def lease_state(store: Store, lease: str) -> tuple[datetime | None, bool]:
    t = store.tables.lease
    with store.engine.connect() as conn:
        row = conn.execute(t.select().where(t.c.id == lease)).one()
    return row.ended_at, bool(row.died)


def test_a_death_long_past_is_no_evidence_once_the_queue_has_been_consumed_since(store: Store) -> None:
    """An idle container killed ten minutes ago, its lease never examined; another container has
    consumed the queue for nine: a delivery it now loses alive is no crash."""
    now = utcnow()
    container_row(store, "killed", now - timedelta(minutes=10))
    lease_row(store, "killed", dead_pid(), now - timedelta(minutes=20))
    lease_row(store, "living", os.getppid(), now - timedelta(minutes=9))  # alive: by its pid
    counter = DeliveryCounter(store)
    assert counter.open("q", "lost-live").count == 0, "an old death charged a live loss"


def test_a_death_counts_for_the_first_consumer_after_it_however_late_it_starts(store: Store) -> None:
    """A crash loop with a slow restart (a back-off of minutes): the message that killed the
    container still counts when the next one comes up."""
    now = utcnow()
    container_row(store, "killed", now - timedelta(minutes=10))
    lease_row(store, "killed", dead_pid(), now - timedelta(minutes=11))
    counter = DeliveryCounter(store)
    counter.sweep()  # as the restarted container does at start, before it consumes
    counter.begin_lease("q", "restarted")
    attempt = counter.open("q", "killer")
    assert (attempt.count, attempt.last_exception) == (1, CRASHED)


def test_the_sweep_ends_a_dead_holders_lease_at_its_last_sign_of_life(store: Store) -> None:
    now = utcnow()
    beat = now - timedelta(seconds=30)
    container_row(store, "killed", beat)
    dead = lease_row(store, "killed", dead_pid(), now - timedelta(minutes=5))
    alive = lease_row(store, "parent", os.getppid(), now - timedelta(minutes=5))
    assert DeliveryCounter(store).sweep() == 1
    ended_at, died = lease_state(store, dead)
    assert died and ended_at is not None
    assert abs((ended_at.replace(tzinfo=None) - beat.replace(tzinfo=None)).total_seconds()) < 1, \
        "ended at its container's last heartbeat, not when found"
    assert lease_state(store, alive) == (None, False)


def test_a_holder_on_another_host_is_alive_within_three_control_intervals(store: Store) -> None:
    """control_interval = 10s: a heartbeat 12 s old is on time, not a death (HOLDER_STALE)."""
    now = utcnow()
    container_row(store, "remote", now - timedelta(seconds=12), host="elsewhere")
    lease_row(store, "remote", 4242, now - timedelta(minutes=1), host="elsewhere")
    counter = DeliveryCounter(store, control_interval=timedelta(seconds=10))
    assert counter.open("q", "lost-live").count == 0, "a living remote container taken for dead"
    container_row(store, "gone", now - timedelta(seconds=40), host="elsewhere")
    lease_row(store, "gone", 4243, now - timedelta(minutes=1), host="elsewhere")
    assert counter.open("q", "killer").count == 1, "a heartbeat three intervals old is a death"


def test_a_redelivery_handed_back_before_its_count_keeps_an_earlier_crash_counting(store: Store) -> None:
    """A crash's redelivery waits in an async consumer's line and is handed back (a stop, a lost
    connection) before step 4: its next redelivery still counts the crash, and only it."""
    now = utcnow()
    container_row(store, "killed", now - timedelta(seconds=5))
    lease_row(store, "killed", dead_pid(), now - timedelta(minutes=1))
    counter = DeliveryCounter(store)
    counter.begin_lease("q", "me")
    counter.hand_back("q", [], unopened=["killer"])
    attempt = counter.open("q", "killer")
    assert (attempt.count, attempt.last_exception) == (1, CRASHED)
    counter.hand_back("q", ["first-seen"])  # a first delivery handed back: its redelivery is clean
    assert counter.open("q", "first-seen").count == 0
