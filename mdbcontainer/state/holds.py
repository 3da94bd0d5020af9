"""Held keys of ordered ports (README "Ordered ports"): one row per key held after a backout.

A port with ``on_backout = "hold"`` writes the row when it backs a message of
the key out; from then on the fleet's containers keep that key's later
messages waiting. ``mdb port release PORT KEY`` deletes the row, and the
containers release the key within a ``control_interval``; a replay of the
backed-out message releases it too (the container deletes the row when the
replayed copy arrives). Rows survive a restart, so a restarted or another
container holds the key as well.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import delete, select

from .store import Store, utcnow


@dataclass(frozen=True)
class HeldKey:
    """A key of an ordered port held after the backout of ``message_id``."""

    port: str
    key: str
    message_id: str
    held_at: datetime


class Holds:
    """Reads and writes the held keys of ordered ports."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.table = store.tables.held

    def hold(self, port: str, key: str, message_id: str) -> None:
        """Hold ``key`` of ``port`` after ``message_id`` was backed out (a new backout replaces it)."""
        t = self.table
        stmt = self.store.insert(t).values(port=port, key=key, message_id=message_id, held_at=utcnow())
        stmt = stmt.on_conflict_do_update(index_elements=[t.c.port, t.c.key],
                                          set_={"message_id": message_id, "held_at": utcnow()})
        with self.store.engine.begin() as conn:
            conn.execute(stmt)

    def release(self, port: str, key: str) -> bool:
        """Release ``key`` of ``port``; False when it was not held."""
        t = self.table
        with self.store.engine.begin() as conn:
            result = conn.execute(delete(t).where(t.c.port == port, t.c.key == key))
        return bool(result.rowcount)

    def of(self, port: str) -> dict[str, str]:
        """The held keys of ``port``: key -> the backed-out message's id."""
        t = self.table
        with self.store.engine.connect() as conn:
            rows = conn.execute(select(t.c.key, t.c.message_id).where(t.c.port == port)).all()
        return {row.key: row.message_id for row in rows}

    def all(self) -> list[HeldKey]:
        """Every held key of the fleet, oldest first."""
        t = self.table
        with self.store.engine.connect() as conn:
            rows = conn.execute(select(t).order_by(t.c.held_at)).all()
        return [HeldKey(r.port, r.key, r.message_id, r.held_at) for r in rows]
