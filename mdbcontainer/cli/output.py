"""How the operating commands print what ``operations/`` returns: tables, JSON, one-liners.

The operations return data (the console shows the same data as a web page);
only this module and ``cli.main`` write to the terminal.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import TYPE_CHECKING, Any

import typer

from ..errors import DlqError
from ..support.terminal import Column, fit

if TYPE_CHECKING:  # each printer imports what it prints: mdb port stop needs no backout queue
    from ..operations import dlq
    from ..operations.ports import DedupPurge, KeyRelease, PortRequest
    from ..settings import Settings
    from ..state.outbox import Waiting

# -- mdb ports, mdb port, mdb dedup ------------------------------------------------------

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


def print_ports(rows: list[dict[str, Any]], as_json: bool) -> None:
    """``mdb ports``: one JSON document, or a table and a line per stopped or stuck port."""
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
        for held in r.get("held") or []:  # an ordered port's key held after a backout
            typer.echo(f"{r['port']} held key {held['key']}: message {held['message_id']} backed "
                       f"out, {held['waiting']} waiting (mdb port release {r['port']} {held['key']})")


def print_outbox(waiting: Waiting, as_json: bool) -> None:
    """``mdb outbox`` (and the last line of ``mdb ports``): the sends waiting, the oldest's age."""
    if as_json:
        typer.echo(json.dumps({"waiting": waiting.count, "oldest_seconds": round(waiting.oldest_seconds, 3)}))
        return
    if not waiting.count:
        typer.echo("outbox: no sends waiting")
        return
    typer.echo(f"outbox: {waiting.count} send{'' if waiting.count == 1 else 's'} waiting, "
               f"the oldest for {waiting.oldest_seconds:.1f}s")


def _cell(row: dict[str, Any], key: str) -> str:
    from ..operations.ports import batch_figures

    if key == "state" and row.get("stuck"):  # a handler past handler_timeout: it needs a restart
        return "stuck"
    if key == "since":
        return str(row.get("since", ""))[:19]
    if key == "batches":  # a batched port's batches and how full they ran: N x mean/size
        return batch_figures(row).split(",")[0]
    if key == "fallbacks":
        return "-" if batch_figures(row) == "-" else str(row.get("fallbacks", 0))
    return str(row.get(key, ""))


def print_port_request(request: PortRequest, as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps({"port": request.port, "requested": request.requested,
                               "within": request.within}))
        return
    typer.echo(f"port {request.port}: {request.requested} requested; "
               f"running containers act within {request.within}")


def print_key_release(release: KeyRelease, as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps({"port": release.port, "key": release.key, "released": release.released,
                               "within": release.within}))
        return
    typer.echo(f"port {release.port}: key {release.key} released; running containers go on with "
               f"it within {release.within}")


def print_dedup_purge(purged: DedupPurge, as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps({"removed": purged.removed, "older_than": purged.older_than}))
        return
    typer.echo(f"removed {purged.removed} dedup row(s) older than {purged.older_than}")


# -- mdb dlq -----------------------------------------------------------------------------

# The id is what ``dlq show`` and ``dlq replay`` need: never cut. In a narrow
# terminal the time goes first, then the port (its destination says as much).
LIST_COLUMNS = (
    Column("id", keep=True), Column("destination", 8), Column("port", 6, drop=2),
    Column("reason", 8), Column("count", 5, right=True), Column("failed at (UTC)", 19, drop=3),
    Column("exception", 10),
)


def print_dlq_list(name: str, letters: list[dlq.BackedOutMessage], total: int, as_json: bool) -> None:
    """``mdb dlq list``: a table that fits the terminal, or one JSON document."""
    from ..operations import dlq

    more = (f"{name}: the first {len(letters)} of {total} message(s) shown (--limit N shows more)"
            if total > len(letters) else "")
    if as_json:
        typer.echo(dlq.dumps([d.to_json() for d in letters]))
        if more:
            typer.echo(more, err=True)
        return
    if not letters:
        typer.echo(f"{name}: no messages")
        return
    typer.echo(more or f"{name}: {total} message(s)")
    rows = []
    for d in letters:
        row = d.to_json()
        rows.append([str(v) if v is not None else "-" for v in (
            row["id"], row["original_destination"], row["port"], row["reason"],
            row["redelivery_count"], _short_time(row["failed_at"]), d.summary())])
    typer.echo("\n".join(fit(LIST_COLUMNS, rows)))


def _short_time(stamp: str | None) -> str | None:
    """``2024-05-01T10:40:53.97+00:00`` as ``2024-05-01 10:40:53`` (the table is narrow)."""
    try:
        return datetime.fromisoformat(stamp or "").strftime("%Y-%m-%d %H:%M:%S")
    except ValueError:
        return stamp


def print_dlq_show(letters: list[dlq.BackedOutMessage], as_json: bool, full: bool = False) -> None:
    """``mdb dlq show``: every header, the full exception, the body (its start, unless ``full``)."""
    from ..operations import dlq

    if as_json:
        typer.echo(dlq.dumps([d.to_json() for d in letters]))
        return
    typer.echo("\n\n".join(_describe(d, full) for d in letters))


def preview(text: str, full: bool) -> str:
    """A body as a terminal can take it: its first BODY_PREVIEW characters, saying what is left out."""
    from ..operations import dlq

    if full or len(text) <= dlq.BODY_PREVIEW:
        return text
    return f"{text[:dlq.BODY_PREVIEW]}… ({len(text) - dlq.BODY_PREVIEW:,} more characters: --full shows them)"


def _describe(d: dlq.BackedOutMessage, full: bool = False) -> str:
    from ..operations import dlq
    from ..wire.headers import EXCEPTION

    body, encoding = dlq.decode_for_display(d.body, d.content_type)
    lines = [f"message {d.id} on {d.queue}", "properties:", f"  content_type: {d.content_type}"]
    lines += [f"  {k}: {v}" for k, v in sorted(d.properties.items()) if k != "content_type"]
    lines.append("headers:")
    for key, value in d.headers.items():
        if key != EXCEPTION:
            lines.append(f"  {key}: {dlq.header_text(value)}")
    lines.append(f"  {EXCEPTION}:")
    lines += [f"    {line}" for line in d.exception.splitlines()]
    # The body as it was sent (its bytes counted above), not JSON parsed and re-spaced.
    shown = d.body.decode("utf-8") if encoding == "json" else body
    lines.append(f"body ({encoding}, {len(d.body):,} bytes): {preview(shown, full)}")
    return "\n".join(lines)


def print_replay(settings: Settings, result: dlq.ReplayResult, queue: str | None, to: str | None) -> None:
    """``mdb dlq replay``: how many moved; a missing id or a refused publish is exit 1."""
    from ..operations import dlq
    from ..wire.headers import REASON_INVALID

    typer.echo(f"replayed {result.replayed} message(s)")
    if result.invalid and to is None:  # back to the same handler, the body fails again: warn
        typer.echo(
            f"warning: {len(result.invalid)} of them are invalid bodies ({REASON_INVALID}: "
            f"{', '.join(result.invalid[:5])}{', ...' if len(result.invalid) > 5 else ''}) and will be "
            "backed out again as they are; fix each body and resend it with "
            "mdb send DEST @fixed.json --id ID, or mdb dlq purge them "
            "(docs/guides/poison-messages.md: Replaying invalid bodies)", err=True)
    problems = dlq.replay_problems(settings, result, queue)
    if problems:
        raise DlqError("; ".join(problems))
