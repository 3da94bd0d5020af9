"""What operators did to the fleet, kept in the container's database (``mdb_history``).

Stopping a port, starting it, replaying and purging backed-out messages change
what the fleet does; the console shows them under History, newest first,
whether they were made in the console or with the CLI. They are kept in the
database beside the port switches, so a restart of the console or of a
container forgets nothing, and every console of a fleet shows the same list.
"""

from __future__ import annotations

import getpass
import socket
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import select

from ..settings import Settings
from ..support.logs import mask_secrets
from .store import Store, utcnow

ACTIONS = ("stop", "start", "replay", "purge", "release")  # release: an ordered port's held key


@dataclass(frozen=True)
class Action:
    """One thing an operator did: when, what, to what, from where and by whom (when known)."""

    at: datetime
    action: str
    target: str
    detail: str
    origin: str
    actor: str | None


class History:
    """Writes and reads the history table of one store."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.table = store.tables.history

    def record(self, action: str, target: str, detail: str, *, origin: str,
               actor: str | None = None) -> None:
        if action not in ACTIONS:
            raise ValueError(f"unknown action {action!r} (one of {', '.join(ACTIONS)})")
        with self.store.engine.begin() as conn:
            conn.execute(self.table.insert().values(
                at=utcnow(), action=action, target=target[:255], detail=mask_secrets(detail),
                origin=origin[:255], actor=actor[:255] if actor else None,
            ))

    def newest(self, limit: int = 200) -> list[Action]:
        t = self.table
        with self.store.engine.connect() as conn:
            rows = conn.execute(select(t).order_by(t.c.at.desc(), t.c.id.desc()).limit(limit)).all()
        return [Action(r.at, r.action, r.target, r.detail, r.origin, r.actor) for r in rows]


def os_user() -> str | None:
    """The login name of this process's user; None where the system has none (a bare container)."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return None


def record_cli(settings: Settings, action: str, target: str, detail: str) -> None:
    """Record an action taken with the ``mdb`` command, by the user who ran it, on this host."""
    store = Store(settings.container)
    try:
        store.create_tables()
        History(store).record(action, target, detail, origin=f"cli on {socket.gethostname()}",
                              actor=os_user())
    finally:
        store.dispose()
