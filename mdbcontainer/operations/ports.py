"""What ``mdb ports``, ``mdb port`` and ``mdb dedup`` do, apart from parsing and printing.

Each returns data; ``cli.output`` prints it (the console shows the same figures).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from ..errors import ListenerError
from ..settings import Settings, format_duration, parse_duration
from ..state.control import STOPPED_BY_OPERATOR, Control
from ..state.dedup import Dedup
from ..state.history import record_cli
from ..state.holds import Holds
from ..state.outbox import Waiting
from ..state.store import Store


def _store(settings: Settings) -> Store:
    store = Store(settings.container)
    store.create_tables()
    return store


def outbox_waiting(settings: Settings) -> Waiting:
    """The sends waiting in the outbox and the age of the oldest (``mdb outbox``, ``mdb ports``)."""
    from ..state.outbox import Outbox
    from ..wire.connection import Broker

    return Outbox(_store(settings), Broker(settings)).waiting()


def live_ports(settings: Settings) -> list[dict[str, Any]]:
    """Every port of every running container, as ``mdb ports --json`` prints them."""
    return Control(_store(settings)).live(control_interval=settings.container.control_interval)


def batch_figures(row: dict[str, Any]) -> str:
    """A batched port's batches: how full they ran against batch_size, and the fallbacks."""
    size = int(row.get("batch_size") or 1)
    batches = int(row.get("batches") or 0)
    if size <= 1 and not batches:
        return "-"
    mean = int(row.get("batched") or 0) / batches if batches else 0.0
    return f"{batches} x {mean:.1f}/{size}, {int(row.get('fallbacks') or 0)} fallbacks"


@dataclass(frozen=True)
class PortRequest:
    """What ``mdb port start|stop`` asked for, and how soon running containers act on it."""

    port: str
    requested: str
    within: str


@dataclass(frozen=True)
class DedupPurge:
    """What ``mdb dedup purge`` removed: how many rows, older than what."""

    removed: int
    older_than: str


def switch_port(settings: Settings, name: str, state: str) -> PortRequest:
    """Ask every running container (and the ones started later) to put port ``name`` in ``state``."""
    _known_port(settings, name)
    reason = "" if state == "started" else STOPPED_BY_OPERATOR
    Control(_store(settings)).set_port(name, state, reason)
    record_cli(settings, "start" if state == "started" else "stop", name, f"{state} requested")
    return PortRequest(name, state, format_duration(settings.container.control_interval))


@dataclass(frozen=True)
class KeyRelease:
    """What ``mdb port release PORT KEY`` did: whether the key was held, and how soon it goes on."""

    port: str
    key: str
    released: bool
    within: str


def release_key(settings: Settings, name: str, key: str) -> KeyRelease:
    """Release a held key of an ordered port in every running container (README "Ordered ports")."""
    _known_port(settings, name)
    released = Holds(_store(settings)).release(name, key)
    if released:
        record_cli(settings, "release", f"{name} {key}"[:255], "held key released")
    return KeyRelease(name, key, released, format_duration(settings.container.control_interval))


def _known_port(settings: Settings, name: str) -> None:
    from ..handlers.binding import bind

    known = {b.name for b in bind(settings)}
    if name not in known:
        # A bad argument, as ``mdb run --port NAME`` says: exit 2, not a reported failure.
        close = difflib.get_close_matches(name, sorted(known), n=1)
        hint = f". Did you mean {close[0]!r}?" if close else ""
        raise ListenerError(
            f"no port {name!r} in {settings.source} (ports: {', '.join(sorted(known))}){hint}"
        )


def purge_dedup(settings: Settings, older_than: str | None) -> DedupPurge:
    """Delete dedup rows older than ``older_than`` (default: ``dedup_retention``)."""
    age = settings.container.dedup_retention if older_than is None else _duration(older_than)
    removed = Dedup(_store(settings)).purge(age)
    return DedupPurge(removed, format_duration(age))


def _duration(text: str) -> timedelta:
    try:
        age: timedelta = parse_duration(text)
        return age
    except ValueError as exc:
        from ..errors import SettingsError

        raise SettingsError(f"--older-than: {exc}") from exc
