"""What the operating commands do (``mdb ports``, ``mdb port``, ``mdb dedup``), apart from parsing."""

from __future__ import annotations

import difflib
import json
from datetime import timedelta
from typing import Any

import typer

from ..errors import ListenerError
from ..settings import Settings, format_duration, parse_duration
from ..state.control import Control
from ..state.dedup import Dedup
from ..state.history import record_cli
from ..state.store import Store
from ..support.terminal import Column, fit


def _store(settings: Settings) -> Store:
    store = Store(settings.container)
    store.create_tables()
    return store


def show_ports(settings: Settings, as_json: bool) -> None:
    rows = Control(_store(settings)).live(control_interval=settings.container.control_interval)
    if as_json:
        typer.echo(json.dumps(rows, indent=2, default=str))
        return
    if not rows:
        typer.echo("no running containers")
        return
    cells = [[_cell(r, key) for key in PORT_FIELDS] for r in rows]
    typer.echo("\n".join(fit(PORT_COLUMNS, cells)))
    for r in rows:  # whole, whatever the width: it names the message that stopped the port
        if r["state"] != "started" and r.get("reason"):
            typer.echo(f"{r['port']} {r['state']}: {r['reason']}")
        for stuck in r.get("stuck") or []:  # past handler_timeout: which message holds it
            typer.echo(f"{r['port']} stuck: consumer {stuck['consumer']} in its handler for "
                       f"{stuck['seconds']:.0f}s on message {', '.join(stuck['message_ids'])}")


# The table's columns are the --json fields, one for one (an invalid body is
# counted in ``invalid body``, not also in ``backed out``). The container and the
# port tell the rows apart: they stay whole on the row's line. In a narrow
# terminal the empty columns go first, then the columns that are all zeros and
# the least needed move to the row's second line: the handled and duplicate
# counts stay longest, so that a skipped duplicate is seen. Each count starts
# from zero with its container (the README's *The mdb command*).
PORT_FIELDS = ("container", "port", "destination", "state", "consecutive_failures", "delivered",
               "handled", "duplicate_skipped", "failed", "backed_out", "invalid_body", "expired",
               "waiting", "batches", "fallbacks", "since", "reason")
PORT_COLUMNS = (
    Column("container", keep=True), Column("port", keep=True), Column("destination", 8),
    Column("state", keep=True), *(
        Column(header, right=True, drop=drop) for header, drop in (
            ("failures", 2), ("delivered", 5), ("handled", 1), ("duplicate", 1), ("failed", 3),
            ("backed out", 3), ("invalid body", 3), ("expired", 4), ("waiting", 3))
    ), Column("batches", 9, right=True, drop=2), Column("fallbacks", right=True, drop=2),
    Column("since", 19, drop=9), Column("reason", 10, drop=6),
)


def _cell(row: dict[str, Any], key: str) -> str:
    if key == "state" and row.get("stuck"):  # a handler past handler_timeout: it needs a restart
        return "stuck"
    if key == "since":
        return str(row.get("since", ""))[:19]
    if key == "batches":  # a batched port's batches and how full they ran: N x mean/size
        return batch_figures(row).split(",")[0]
    if key == "fallbacks":
        return "-" if batch_figures(row) == "-" else str(row.get("fallbacks", 0))
    return str(row.get(key, ""))


def batch_figures(row: dict[str, Any]) -> str:
    """A batched port's batches: how full they ran against batch_size, and the fallbacks."""
    size = int(row.get("batch_size") or 1)
    batches = int(row.get("batches") or 0)
    if size <= 1 and not batches:
        return "-"
    mean = int(row.get("batched") or 0) / batches if batches else 0.0
    return f"{batches} x {mean:.1f}/{size}, {int(row.get('fallbacks') or 0)} fallbacks"


def switch_port(settings: Settings, name: str, state: str, as_json: bool = False) -> None:
    from ..runtime.container import bind
    from ..runtime.endpoints import STOPPED_BY_OPERATOR

    known = {b.name for b in bind(settings)}
    if name not in known:
        # A bad argument, as ``mdb run --port NAME`` says: exit 2, not a reported failure.
        close = difflib.get_close_matches(name, sorted(known), n=1)
        hint = f". Did you mean {close[0]!r}?" if close else ""
        raise ListenerError(
            f"no port {name!r} in {settings.source} (ports: {', '.join(sorted(known))}){hint}"
        )
    reason = "" if state == "started" else STOPPED_BY_OPERATOR
    Control(_store(settings)).set_port(name, state, reason)
    record_cli(settings, "start" if state == "started" else "stop", name, f"{state} requested")
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
        from ..errors import SettingsError

        raise SettingsError(f"--older-than: {exc}") from exc
