"""Durable redelivery counts: how many times a message failed, across processes.

RabbitMQ classic queues carry no delivery count, so the count lives in the
container's database, keyed by (queue, message id). Nothing is written on a
first delivery; a redelivered one opens an attempt before the handler runs,
and a failure or a graceful hand-back closes it.

An earlier delivery that nobody closed ended in one of two ways: its process
died (a crash: it counts, so a message that kills the container ends in the
backout queue instead of looping), or a container that lives on lost its
connection (a broker restart, an operator closing it, a missed heartbeat: it
does not count, and neither do the prefetched deliveries it never saw). The
difference is told by evidence, not by a missing record: each consumer
connection writes one lease row before it consumes (nothing per message),
ends it when the connection ends, and a process that dies leaves it open. So
the redelivery that finds an unclosed earlier delivery charges it as a crash
only when a lease of its queue was left open by a holder that is gone (its
process no longer runs on this host, or its container's row is gone or stale
on another host); otherwise it closes it uncounted. A competing consumer that
receives a living container's deliveries first sees that container's lease
open and its holder alive, so it wins no race.

A death is evidence for a while only. The broker requeues a dead holder's
deliveries as its connection drops, and they reach the queue's next
consumer at once: the one consuming then, or the first to start after. So a
dead lease counts from its holder's last sign of life (its container's
heartbeat) until DEATH_EVIDENCE after that consumer could receive them, and
no longer: an idle container killed an hour ago does not turn a later live
loss into crashes. Dead leases are found by every redelivery that examines
them and by :meth:`DeliveryCounter.sweep` (at a container's start and in its
housekeeping), which ends them at that last sign of life, not when found.
A living consumer that loses its connection records the hand-back of the
deliveries it had seen (a waiting line, a batch, held messages), so that
those do not count even while a death on the queue is evidence.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, delete, or_, select, update

from .control import stale_after
from .store import Store, utcnow

CRASHED = "the container process died during this delivery (killed, crashed or lost its broker connection)"
# A dead lease is the evidence of a death on its queue this long after the queue's
# next consumer could receive its deliveries: they are redelivered within it.
DEATH_EVIDENCE = timedelta(minutes=5)
# Ended leases are deleted after this long (when a consumer writes a new one).
LEASE_RETENTION = timedelta(days=1)

@dataclass(frozen=True)
class Attempt:
    """What the durable count says of the delivery about to run."""

    count: int
    last_exception: str | None



class DeliveryCounter:
    """Durable per-message delivery counts (one round trip, only off the first-delivery path)."""

    def __init__(self, store: Store, control_interval: timedelta | None = None) -> None:
        """``control_interval``: how often containers write their heartbeat (the settings'); another
        host's container is gone once its heartbeat is three of them old (never under 10 s)."""
        self.store = store
        self.table = store.tables.delivery
        self._container: str | None = None  # this process's container id, once it holds a lease
        self.holder_stale = stale_after(control_interval)

    def _upsert(self, queue: str, message_id: str, **increments: int | str) -> Any:
        t = self.table
        values = {"queue": queue, "message_id": message_id, "opened": 0, "closed": 0,
                  "failures": 0, "updated_at": utcnow()}
        extra = {k: v for k, v in increments.items() if k == "last_exception"}
        counts = {k: v for k, v in increments.items() if k != "last_exception"}
        values.update(counts)
        values.update(extra)
        stmt = self.store.insert(t).values(values)
        update = {k: t.c[k] + v for k, v in counts.items()}
        update.update({k: stmt.excluded[k] for k in extra})
        update["updated_at"] = stmt.excluded.updated_at
        return stmt.on_conflict_do_update(
            index_elements=[t.c.queue, t.c.message_id], set_=update
        ).returning(t.c.opened, t.c.closed, t.c.failures, t.c.last_exception)

    def open(self, queue: str, message_id: str) -> Attempt:
        """Record that a delivery starts and return its count of earlier failed deliveries.

        Only redeliveries are recorded (the broker flags them), so the first
        delivery was never recorded and counts as opened. An earlier delivery
        nobody closed is closed here, charged as a crash only on the evidence
        of a death (see the module's docstring).
        """
        with self.store.engine.begin() as conn:
            opened, closed, failures, last = conn.execute(
                self._upsert(queue, message_id, opened=1)
            ).one()
            unclosed = max(0, opened - closed)  # ``opened`` counts the first, unrecorded delivery
            if not unclosed:
                return Attempt(failures, last)
            died = self._death_on(conn, queue)
            values: dict[str, Any] = {"closed": self.table.c.closed + unclosed}
            if died:
                failures += unclosed
                last = CRASHED
                values.update(failures=self.table.c.failures + unclosed, last_exception=CRASHED)
            conn.execute(update(self.table).where(
                self.table.c.queue == queue, self.table.c.message_id == message_id).values(values))
        return Attempt(failures, last)

    # -- leases: one row per consumer connection, the evidence of a death -----

    def begin_lease(self, queue: str, container: str) -> str:
        """Write the lease of a consumer connection about to consume ``queue``; return its id."""
        self._container = container
        lease = uuid.uuid4().hex
        now = utcnow()
        t = self.store.tables.lease
        with self.store.engine.begin() as conn:
            conn.execute(delete(t).where(t.c.ended_at < now - LEASE_RETENTION))
            conn.execute(t.insert().values(
                id=lease, queue=queue, container=container, host=socket.gethostname(),
                pid=os.getpid(), started_at=now, ended_at=None, died=False))
        return lease

    def end_lease(self, lease: str) -> None:
        """The connection ended in a living container: none of its deliveries counts."""
        t = self.store.tables.lease
        with self.store.engine.begin() as conn:
            conn.execute(update(t).where(t.c.id == lease, t.c.ended_at.is_(None))
                         .values(ended_at=utcnow()))

    def end_leases_of(self, container: str) -> None:
        """A container stops gracefully: end every lease it still holds."""
        t = self.store.tables.lease
        with self.store.engine.begin() as conn:
            conn.execute(update(t).where(t.c.container == container, t.c.ended_at.is_(None))
                         .values(ended_at=utcnow()))

    def sweep(self) -> int:
        """End the open leases whose holder is gone, at its last sign of life; return how many.

        Run at a container's start (before it consumes: an earlier life's lease
        of this pid is found dead) and in its housekeeping, so that a death is
        found soon after it and its evidence runs from then, never from a
        redelivery that examines it much later.
        """
        t = self.store.tables.lease
        with self.store.engine.begin() as conn:
            rows = conn.execute(select(t).where(t.c.ended_at.is_(None))).all()
            return len(self._end_dead(conn, rows))

    def _end_dead(self, conn: Connection, rows: Sequence[Any]) -> dict[str, datetime]:
        """Mark the leases of ``rows`` whose holder is gone died; their id: last sign of life."""
        dead = {row.id: self._last_seen(conn, row) for row in rows if not self._holder_alive(conn, row)}
        t = self.store.tables.lease
        for lease, seen in dead.items():
            conn.execute(update(t).where(t.c.id == lease, t.c.ended_at.is_(None))
                         .values(ended_at=seen, died=True))
        return dead

    def _death_on(self, conn: Connection, queue: str) -> bool:
        """Whether a lease of ``queue`` shows a death whose deliveries may be coming back now."""
        t = self.store.tables.lease
        rows = conn.execute(select(t).where(t.c.queue == queue, or_(
            t.c.ended_at.is_(None), t.c.died.is_(True)))).all()
        deaths = self._end_dead(conn, [row for row in rows if row.ended_at is None])
        deaths.update({row.id: _aware(row.ended_at) for row in rows if row.died})
        if not deaths:
            return False
        now = utcnow()
        by_id = {row.id: row for row in rows}
        return any(now <= self._received_by(conn, by_id[lease], seen) + DEATH_EVIDENCE
                   for lease, seen in deaths.items())

    def _received_by(self, conn: Connection, lease: Any, seen: datetime) -> datetime:
        """When the queue's next consumer could receive what ``lease``'s death requeued: at its
        holder's last sign of life ``seen`` if another container consumed then, else when the
        first one started after it (now, while none has: they wait in the queue)."""
        t = self.store.tables.lease
        starts = conn.execute(select(t.c.started_at).where(
            t.c.queue == lease.queue, t.c.container != lease.container,
            or_(t.c.ended_at.is_(None), t.c.ended_at >= seen))).scalars().all()
        if not starts:
            return utcnow()
        return max(seen, min(_aware(start) for start in starts))

    def _last_seen(self, conn: Connection, lease: Any) -> datetime:
        """A dead holder's last sign of life: its container's last heartbeat, else now (its row is
        gone: a supervisor that saw it die deletes it at once)."""
        c = self.store.tables.container
        beat = conn.execute(select(c.c.heartbeat_at).where(c.c.id == lease.container)).scalar()
        if beat is None:
            return utcnow()
        return max(_aware(beat), _aware(lease.started_at))

    def _holder_alive(self, conn: Connection, lease: Any) -> bool:
        """A lease's process runs: by its pid on this host, by its container's heartbeat elsewhere."""
        if lease.host == socket.gethostname():
            if lease.pid == os.getpid():  # a restarted container often gets its pid back (pid 1)
                return bool(lease.container == self._container)
            return _process_runs(lease.pid)
        c = self.store.tables.container
        beat = conn.execute(select(c.c.heartbeat_at).where(c.c.id == lease.container)).scalar()
        if beat is None:
            return False
        return bool(utcnow() - _aware(beat) < self.holder_stale)

    def failures(self, queue: str, message_id: str) -> int:
        """The recorded failures of a message so far (a read: opens no attempt)."""
        t = self.table
        with self.store.engine.connect() as conn:
            found = conn.execute(
                select(t.c.failures).where(t.c.queue == queue, t.c.message_id == message_id)
            ).scalar()
        return int(found or 0)

    def fail(self, queue: str, message_id: str, text: str) -> int:
        """Record a failed delivery (durably, before the message is requeued); return the
        message's failures now, this one included.

        That can be more than the delivery's count plus one: another copy of the
        message (a producer's retry, an original redelivered after a crash beside
        its copy on a wait queue) may have failed while this one ran. What leaves
        to wait must carry this figure, or it comes back taken for a stale copy.
        """
        with self.store.engine.begin() as conn:
            _opened, _closed, failures, _last = conn.execute(
                self._upsert(queue, message_id, failures=1, closed=1, last_exception=text)).one()
        return int(failures)

    def hand_back(self, queue: str, message_ids: list[str], *, unopened: list[str] | None = None) -> None:
        """Record deliveries returned unprocessed (a graceful stop, a lost connection), so they do
        not count.

        ``unopened``: redeliveries returned before their count was opened; recorded as
        opened and closed, so that an earlier delivery nobody closed still counts.
        """
        if not message_ids and not unopened:
            return
        with self.store.engine.begin() as conn:
            for message_id in message_ids:
                conn.execute(self._upsert(queue, message_id, closed=1))
            for message_id in unopened or []:
                conn.execute(self._upsert(queue, message_id, opened=1, closed=1))

    def reset(self, queue: str, message_id: str) -> None:
        """Forget a message's count (a replay from the backout queue starts again at 0)."""
        with self.store.engine.begin() as conn:
            conn.execute(
                delete(self.table).where(
                    self.table.c.queue == queue, self.table.c.message_id == message_id
                )
            )


def _aware(moment: datetime) -> datetime:
    """``moment`` with its zone: SQLite keeps none, and the container writes UTC."""
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=utcnow().tzinfo)


def _process_runs(pid: int) -> bool:
    """Whether process ``pid`` of this host runs (a zombie, dead and not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: it exists
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc: the signal check above is all there is
    return stat.rpartition(")")[2].split()[:1] != ["Z"]

