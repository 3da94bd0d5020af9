"""The ``mdb`` command: parse, load settings, delegate.

Every command takes ``-c/--config FILE`` (else ``$MDB_SETTINGS``, else
``./settings.toml``). Exit codes: 0 success, 1 a failure the command reports,
2 bad usage or bad settings; every error is one line naming the culprit.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Annotated, Any, NoReturn, TypeVar

import typer
from sqlalchemy.exc import SQLAlchemyError

from .errors import ListenerError, MdbError, SettingsError
from .logs import setup_logging
from .settings import Settings, load_settings, mask_url

app = typer.Typer(
    name="mdb",
    help="Run and operate message-driven handlers behind listener ports.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
port_app = typer.Typer(help="Start or stop a listener port in the running containers.",
                       no_args_is_help=True)
dlq_app = typer.Typer(help="Browse, replay and purge backout queues.", no_args_is_help=True)
dedup_app = typer.Typer(help="Maintain the dedup table.", no_args_is_help=True)
app.add_typer(port_app, name="port")
app.add_typer(dlq_app, name="dlq")
app.add_typer(dedup_app, name="dedup")

ConfigOption = Annotated[
    Path | None,
    typer.Option("-c", "--config", help="Settings file (default: $MDB_SETTINGS, else ./settings.toml)."),
]
JsonOption = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout.")]
PortName = Annotated[str, typer.Argument(metavar="NAME", help="A port of the settings, e.g. Work.")]

T = TypeVar("T")


def fail(message: str, code: int = 1) -> NoReturn:
    """Print one line to stderr and exit."""
    typer.echo(f"mdb: error: {mask_url(message)}", err=True)
    raise typer.Exit(code)


def guarded(action: Callable[[], T]) -> T:
    """Run ``action``, turning the package's errors into one line and the right exit code."""
    try:
        return action()
    except (SettingsError, ListenerError) as exc:
        fail(str(exc), 2)
    except MdbError as exc:
        fail(str(exc), 1)
    except SQLAlchemyError as exc:  # the database is away or refused: one line, not a traceback
        from .broker import describe

        fail(f"database: {describe(exc)}", 1)


def settings_for(config: Path | None) -> Settings:
    return guarded(lambda: load_settings(config))


def usage_error(message: str) -> NoReturn:
    fail(message, 2)


# -- run and check -------------------------------------------------------------


@app.command()
def run(
    config: ConfigOption = None,
    port: Annotated[
        list[str] | None, typer.Option("--port", help="Run only this port (repeatable).")
    ] = None,
) -> None:
    """Run the container: every port of the settings, or only the named ones."""
    from .container import Container

    settings = settings_for(config)
    setup_logging(settings.container)
    container = guarded(lambda: Container(settings, ports=port))
    raise typer.Exit(guarded(container.run))


@app.command()
def check(config: ConfigOption = None) -> None:
    """Validate the settings and import the listeners; warn about risky poison-message settings."""
    from .acknowledge import check_mode
    from .broker import Broker
    from .check import warnings_for
    from .container import bind

    settings = settings_for(config)
    bindings = guarded(lambda: bind(settings))
    caps = Broker(settings).capabilities
    for binding in bindings:
        guarded(partial(check_mode, settings.source, binding.name, binding.settings.acknowledge, caps))
    warnings = warnings_for(settings, bindings)
    for line in warnings:
        typer.echo(f"warning: {line}", err=True)
    typer.echo(
        f"{settings.source}: ok: {len(bindings)} port(s) "
        f"({', '.join(b.name for b in bindings)}); broker {mask_url(settings.container.broker_url)}"
        + (f"; {len(warnings)} warning(s)" if warnings else "")
    )


# -- producing -------------------------------------------------------------------


def parse_body(text: str) -> Any:
    """BODY is JSON, or ``@file`` holding JSON."""
    source = "BODY"
    if text.startswith("@"):
        source = text[1:]
        try:
            text = Path(source).read_text(encoding="utf-8")
        except OSError as exc:
            usage_error(f"BODY {source}: cannot read: {exc.strerror}")
    try:
        return json.loads(text)
    except ValueError as exc:
        usage_error(f"{source} is not JSON ({exc}); quote text as a JSON string: '\"text\"'")


def positive_seconds(option: str, text: str) -> float:
    """A duration option (``30s``, ``500ms``) as seconds; bad usage unless it is positive."""
    from .settings import parse_duration

    try:
        seconds: float = parse_duration(text).total_seconds()
    except ValueError as exc:
        usage_error(f"{option}: {exc}")
    if seconds <= 0:
        usage_error(f"{option}: must be positive, not {text!r}")
    return seconds


def parse_headers(pairs: list[str]) -> dict[str, Any]:
    headers: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            usage_error(f"-H {pair!r}: expected key=value")
        headers[key] = value
    return headers


@app.command()
def send(
    destination: Annotated[str, typer.Argument(help="A queue or topic named in the settings, else a queue.")],
    body: Annotated[str, typer.Argument(help="The body as JSON, or @file.")],
    config: ConfigOption = None,
    priority: Annotated[int | None, typer.Option(help="0-9 (default 4).", min=0, max=9)] = None,
    ttl: Annotated[str | None, typer.Option(help="Time to live, e.g. 30s.")] = None,
    non_persistent: Annotated[bool, typer.Option("--non-persistent", help="Do not write to disk.")] = False,
    message_id: Annotated[str | None, typer.Option("--id", help="Message id (default: a new uuid).")] = None,
    header: Annotated[
        list[str] | None, typer.Option("-H", "--header", help="key=value (repeatable).")
    ] = None,
    reply_to: Annotated[str | None, typer.Option("--reply-to", help="Queue for the reply.")] = None,
    correlation_id: Annotated[
        str | None, typer.Option("--correlation-id", help="Correlation id (to answer a request).")
    ] = None,
    count: Annotated[int, typer.Option(help="Send N copies (ids -1..-N after --id).", min=1)] = 1,
) -> None:
    """Send a message (confirmed by the broker); print its id."""
    from .producer import Producer

    data = parse_body(body)
    headers = parse_headers(header or [])
    if ttl is not None:
        positive_seconds("--ttl", ttl)
    settings = settings_for(config)

    def go() -> None:
        with Producer.from_settings(settings) as producer:
            for n in range(count):
                mid = message_id if count == 1 or not message_id else f"{message_id}-{n + 1}"
                sent = producer.send(
                    destination, data, priority=priority, ttl=ttl, persistent=not non_persistent,
                    headers=headers, message_id=mid, reply_to=reply_to,
                    correlation_id=correlation_id,
                )
                typer.echo(sent)

    guarded(go)


# -- operating ---------------------------------------------------------------------


@app.command()
def ports(
    config: ConfigOption = None,
    as_json: JsonOption = False,
    watch: Annotated[
        bool, typer.Option("--watch", help="A live table, redrawn every second, until Ctrl-C.")
    ] = False,
    iterations: Annotated[int | None, typer.Option(hidden=True, min=1)] = None,
) -> None:
    """Every port of every running container: state, reason, counts."""
    from .operate import show_ports

    if watch and as_json:
        usage_error("--watch draws a live table; for scripts, poll mdb ports --json instead")
    settings = settings_for(config)
    if watch:
        from .watch import watch as watch_ports

        guarded(lambda: watch_ports(settings, iterations))
        return
    guarded(lambda: show_ports(settings, as_json))


@port_app.command("start")
def port_start(name: PortName, config: ConfigOption = None, as_json: JsonOption = False) -> None:
    """Start port NAME in every running container (and for containers started later)."""
    from .operate import switch_port

    settings = settings_for(config)
    guarded(lambda: switch_port(settings, name, "started", as_json))


@port_app.command("stop")
def port_stop(name: PortName, config: ConfigOption = None, as_json: JsonOption = False) -> None:
    """Stop port NAME in every running container (and for containers started later)."""
    from .operate import switch_port

    settings = settings_for(config)
    guarded(lambda: switch_port(settings, name, "stopped", as_json))


@dedup_app.command("purge")
def dedup_purge(
    config: ConfigOption = None,
    older_than: Annotated[
        str | None, typer.Option("--older-than", help="e.g. 7d (default: dedup_retention).")
    ] = None,
    as_json: JsonOption = False,
) -> None:
    """Delete dedup rows past retention, in short batches."""
    from .operate import purge_dedup

    settings = settings_for(config)
    guarded(lambda: purge_dedup(settings, older_than, as_json))


# -- backout queues ---------------------------------------------------------------

QueueArgument = Annotated[
    str | None, typer.Argument(help="A backout queue (default: container.dead_letter_queue).")
]
QueueOption = Annotated[
    str | None,
    typer.Option("--queue", help="Only this queue (default: the backout queues of the settings)."),
]
AllOption = Annotated[bool, typer.Option("--all", help="Every message of the queue(s).")]
ToOption = Annotated[
    str | None, typer.Option("--to", help="Destination (default: the original destination).")
]


@dlq_app.command("list")
def dlq_list(queue: QueueArgument = None, config: ConfigOption = None,
             as_json: JsonOption = False) -> None:
    """Browse a backout queue without consuming: every message stays, in its order."""
    from .dlq import list_command

    settings = settings_for(config)
    guarded(lambda: list_command(settings, queue, as_json))


@dlq_app.command("show")
def dlq_show(message_id: Annotated[str, typer.Argument(metavar="ID", help="The message id.")],
             queue: QueueOption = None, config: ConfigOption = None,
             as_json: JsonOption = False) -> None:
    """One message of a backout queue with all its headers and the full exception."""
    from .dlq import show_command

    settings = settings_for(config)
    guarded(lambda: show_command(settings, message_id, queue, as_json))


@dlq_app.command("replay")
def dlq_replay(
    ids: Annotated[list[str] | None, typer.Argument(metavar="ID", help="Message ids.")] = None,
    replay_all: AllOption = False,
    queue: QueueOption = None,
    to: ToOption = None,
    config: ConfigOption = None,
) -> None:
    """Move messages back to their original destination (or --to), redelivery count reset."""
    from .dlq import replay_command

    if bool(ids) == replay_all:
        usage_error("give the message IDs to replay, or --all (not both)")
    settings = settings_for(config)
    guarded(lambda: replay_command(settings, ids or [], replay_all, queue, to))


@dlq_app.command("purge")
def dlq_purge(
    queue: QueueArgument = None,
    config: ConfigOption = None,
    yes: Annotated[bool, typer.Option("--yes", help="Confirm: delete them all.")] = False,
) -> None:
    """Empty a backout queue (needs --yes)."""
    from .dlq import purge_command

    settings = settings_for(config)
    if not yes:
        name = queue or settings.container.dead_letter_queue
        usage_error(f"purge deletes every message on {name}: add --yes to confirm")
    guarded(lambda: purge_command(settings, queue))


# -- request/reply and durable subscriptions (seed 001) ----------------------------


@app.command()
def request(
    destination: Annotated[str, typer.Argument(help="A queue or topic named in the settings, else a queue.")],
    body: Annotated[str, typer.Argument(help="The body as JSON, or @file.")],
    config: ConfigOption = None,
    timeout: Annotated[str, typer.Option(help="How long to wait for the reply, e.g. 10s.")] = "10s",
) -> None:
    """Send with a temporary reply queue; print the reply's body as JSON on stdout."""
    from .producer import Producer

    data = parse_body(body)
    seconds = positive_seconds("--timeout", timeout)
    settings = settings_for(config)

    def go() -> None:
        with Producer.from_settings(settings) as producer:
            reply = producer.request(destination, data, timeout=seconds)
        typer.echo(json.dumps(reply.body))

    guarded(go)


@app.command()
def unsubscribe(
    client_id: Annotated[str, typer.Argument(metavar="CLIENT_ID", help="The subscription's client_id.")],
    subscription: Annotated[str, typer.Argument(metavar="SUBSCRIPTION", help="Its subscription name.")],
    config: ConfigOption = None,
) -> None:
    """Delete a durable subscription and what it holds (refused while a port consumes it)."""
    from .broker import Broker
    from .subscriptions import unsubscribe as delete_subscription

    settings = settings_for(config)
    dropped = guarded(lambda: delete_subscription(Broker(settings), client_id, subscription))
    typer.echo(f"deleted durable subscription {client_id}.{subscription} "
               f"({dropped} message(s) discarded)")


def main() -> None:
    """Console entry point."""
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)
