"""What the operating commands do (``mdb ports``, ``mdb port``, ``mdb dedup``), apart from parsing."""

from __future__ import annotations

import json
from datetime import timedelta

import typer
from rich.console import Console
from rich.table import Table

from .control import Control
from .dedup import Dedup
from .errors import ListenerError
from .settings import Settings, format_duration, parse_duration
from .store import Store


def _store(settings: Settings) -> Store:
    store = Store(settings.container)
    store.create_tables()
    return store


def show_ports(settings: Settings, as_json: bool) -> None:
    rows = Control(_store(settings)).live()
    if as_json:
        typer.echo(json.dumps(rows, indent=2, default=str))
        return
    if not rows:
        typer.echo("no running containers")
        return
    table = Table(title="listener ports")
    for column in ("container", "port", "destination", "state", "failures", "delivered",
                   "failed", "backed out", "expired", "since", "reason"):
        table.add_column(column)
    for r in rows:
        table.add_row(
            r["container"], r["port"], str(r["destination"]),
            f"[green]{r['state']}[/]" if r["state"] == "started" else f"[red]{r['state']}[/]",
            str(r["consecutive_failures"]), str(r["delivered"]), str(r["failed"]),
            # What went to the backout queue: an invalid body is counted apart in --json.
            str(r["backed_out"] + r.get("invalid_body", 0)), str(r["expired"]), r["since"][:19],
            r["reason"] or "",
        )
    Console(width=200).print(table)


def switch_port(settings: Settings, name: str, state: str, as_json: bool = False) -> None:
    from .container import bind
    from .endpoints import STOPPED_BY_OPERATOR

    known = {b.name for b in bind(settings)}
    if name not in known:
        # A bad argument, as ``mdb run --port NAME`` says: exit 2, not a reported failure.
        raise ListenerError(
            f"no port {name!r} in {settings.source} (ports: {', '.join(sorted(known))})"
        )
    reason = "" if state == "started" else STOPPED_BY_OPERATOR
    Control(_store(settings)).set_port(name, state, reason)
    within = format_duration(settings.container.control_interval)
    if as_json:
        typer.echo(json.dumps({"port": name, "requested": state, "within": within}))
        return
    typer.echo(f"port {name}: {state} requested; running containers act within {within}")


def purge_dedup(settings: Settings, older_than: str | None, as_json: bool = False) -> None:
    age = settings.container.dedup_retention if older_than is None else _duration(older_than)
    removed = Dedup(_store(settings)).purge(age)
    if as_json:
        typer.echo(json.dumps({"removed": removed, "older_than": format_duration(age)}))
        return
    typer.echo(f"removed {removed} dedup row(s) older than {format_duration(age)}")


def _duration(text: str) -> timedelta:
    try:
        age: timedelta = parse_duration(text)
        return age
    except ValueError as exc:
        from .errors import SettingsError

        raise SettingsError(f"--older-than: {exc}") from None
