"""Port state shared by the containers of a fleet, through the container's database.

Each container process has a row in ``mdb_container``, refreshed every
``control_interval`` with its ports' state and counters (the heartbeat);
``mdb ports`` reads those rows. The wanted state of each port is a row in
``mdb_port``: a port that exceeds Maximum retries writes ``stopped`` there,
so every replica stops it (one poison message would otherwise stop them one
by one), and ``mdb port start NAME`` writes ``started``. Containers poll the
table, so the CLI needs no connection to them, and several processes on the
same settings (scale-out) obey the same switch.
"""

from __future__ import annotations

import json
import os
import socket
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import delete, select, update

from .store import Store, utcnow

STALE_AFTER = timedelta(seconds=10)
# The reason ``mdb port stop`` writes; such a port is stopped as configured (``/readyz``).
STOPPED_BY_OPERATOR = "stopped by mdb port stop"


@dataclass(frozen=True)
class Wanted:
    """A port's wanted state, as the fleet sees it."""

    state: str
    reason: str
    generation: int


def stale_after(control_interval: timedelta | None) -> timedelta:
    """How old a container's heartbeat is when it counts as gone: three heartbeats of
    ``control_interval``, never less than STALE_AFTER (a slow poller is not dead)."""
    return max(STALE_AFTER, 3 * control_interval) if control_interval else STALE_AFTER


def new_container_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


class Control:
    """Reads and writes the fleet's port switches and the containers' heartbeats."""

    def __init__(self, store: Store, container_id: str | None = None) -> None:
        self.store = store
        self.id = container_id or new_container_id()
        self.ports = store.tables.port
        self.containers = store.tables.container

    def register(self) -> None:
        now = utcnow()
        with self.store.engine.begin() as conn:
            conn.execute(self.containers.insert().values(
                id=self.id, host=socket.gethostname(), pid=os.getpid(), started_at=now,
                heartbeat_at=now, stopped=False, stats="[]",
            ))

    def heartbeat(self, stats: list[dict[str, Any]]) -> None:
        with self.store.engine.begin() as conn:
            conn.execute(
                update(self.containers).where(self.containers.c.id == self.id).values(
                    heartbeat_at=utcnow(), stats=json.dumps(stats, default=str)
                )
            )

    def deregister(self) -> None:
        with self.store.engine.begin() as conn:
            conn.execute(delete(self.containers).where(self.containers.c.id == self.id))

    def forget_process(self, pid: int, died_at: datetime) -> int:
        """Delete the row of a dead process of this host (its supervisor saw it die).

        ``mdb ports`` then shows the fleet as it is at once, rather than the
        dead container until its heartbeat goes stale. Rows started after the
        death belong to a new process that was given the same pid.
        """
        c = self.containers.c
        with self.store.engine.begin() as conn:
            result = conn.execute(delete(self.containers).where(
                c.host == socket.gethostname(), c.pid == pid, c.started_at <= died_at))
        return int(result.rowcount or 0)

    def wanted(self) -> dict[str, Wanted]:
        with self.store.engine.connect() as conn:
            rows = conn.execute(select(self.ports)).all()
        return {r.name: Wanted(r.state, r.reason or "", r.generation) for r in rows}

    def set_port(self, name: str, state: str, reason: str = "") -> None:
        """Switch a port for the whole fleet (``started`` or ``stopped``)."""
        t = self.ports
        stmt = self.store.insert(t).values(name=name, state=state, reason=reason, since=utcnow(),
                                      generation=1)
        stmt = stmt.on_conflict_do_update(
            index_elements=[t.c.name],
            set_={"state": state, "reason": reason, "since": stmt.excluded.since,
                  "generation": t.c.generation + 1},
        )
        with self.store.engine.begin() as conn:
            conn.execute(stmt)

    def live(self, now: datetime | None = None, *,
             control_interval: timedelta | None = None) -> list[dict[str, Any]]:
        """Every port of every running container: its heartbeat is fresh.

        Fresh is younger than three heartbeats of ``control_interval`` (the
        settings'), and never less than STALE_AFTER, so that a container
        polling slowly does not vanish from ``mdb ports`` between heartbeats.
        """
        cutoff = (now or utcnow()) - stale_after(control_interval)
        with self.store.engine.connect() as conn:
            rows = conn.execute(
                select(self.containers).where(self.containers.c.heartbeat_at >= cutoff)
                .order_by(self.containers.c.started_at)
            ).all()
        out = []
        for row in rows:
            for port in json.loads(row.stats):
                out.append({"container": row.id, **port})
        return out
