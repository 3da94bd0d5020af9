"""The ``mdb`` command: parse, load settings, delegate.

Every command takes ``-c/--config FILE`` (else ``$MDB_SETTINGS``, else
``./settings.toml``). Exit codes: 0 success, 1 a failure the command reports,
2 bad usage or bad settings; every error is one line naming the culprit.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import sys
import threading
from collections.abc import Callable
from contextlib import suppress
from functools import partial
from pathlib import Path
from typing import Annotated, Any, NoReturn, TypeVar

import typer
from typer.core import TyperCommand

try:  # recent typer vendors click; before, it used click itself
    from typer._click.exceptions import ClickException, NoArgsIsHelpError
except ImportError:  # pragma: no cover
    # click is there beside a recent typer too when the console extra (uvicorn) is installed
    from click.exceptions import (  # type: ignore[import-not-found,no-redef,assignment,unused-ignore]
        ClickException,
        NoArgsIsHelpError,
    )

from ..errors import MdbError
from ..settings import Settings, load_settings, mask_url
from ..support.logs import setup_logging

# One help style for every command: ``-h`` is ``--help`` (click hands the setting down to
# every subcommand's context); placeholders are UPPERCASE (``--ttl DURATION``, ``QUEUE``);
# plain click layout, where a flag carries no value label and the help fits 80 columns.
STYLE: dict[str, Any] = {
    "no_args_is_help": True,
    "context_settings": {"help_option_names": ["-h", "--help"]},
    "rich_markup_mode": None,
}

app = typer.Typer(
    name="mdb",
    help="Run and operate message-driven handlers behind listener ports.",
    add_completion=False,
    pretty_exceptions_enable=False,
    **STYLE,
)


class Command(TyperCommand):
    """A command whose arguments are listed by their placeholder alone (typer adds ``<str>``)."""

    def format_options(self, ctx: Any, formatter: Any) -> None:
        arguments, options = [], []
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None:
                continue
            if param.param_type_name == "argument":
                arguments.append((param.metavar or str(param.name).upper(), record[1]))
            else:
                options.append(record)
        for title, rows in (("Arguments", arguments), ("Options", options)):
            if rows:
                with formatter.section(title):
                    formatter.write_dl(rows)


port_app = typer.Typer(help="Start or stop a listener port, or release a held key, in the running "
                       "containers.", **STYLE)
dlq_app = typer.Typer(help="Browse, replay and purge backout queues.", **STYLE)
dedup_app = typer.Typer(help="Maintain the dedup table.", **STYLE)
app.add_typer(port_app, name="port")
app.add_typer(dlq_app, name="dlq")
app.add_typer(dedup_app, name="dedup")

ConfigOption = Annotated[
    Path | None,
    typer.Option("-c", "--config", metavar="FILE",
                 help="Settings file (default: $MDB_SETTINGS, else ./settings.toml)."),
]
JsonOption = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout.")]
DestArgument = Annotated[
    str, typer.Argument(metavar="DEST", help="A queue or topic named in the settings, else a queue.")
]
BodyArgument = Annotated[str, typer.Argument(metavar="BODY", help="The body as JSON, or @FILE holding it.")]

T = TypeVar("T")


def fail(message: str, code: int = 1) -> NoReturn:
    """Print one line to stderr and exit."""
    typer.echo(f"mdb: error: {mask_url(message)}", err=True)
    raise typer.Exit(code)


def guarded(action: Callable[[], T]) -> T:
    """Run ``action``, turning the package's errors into one line and the right exit code."""
    try:
        return action()
    except MdbError as exc:  # the class knows its exit code: 2 for settings and listeners
        fail(str(exc), exc.exit_code)
    except OSError as exc:  # a folder or file the command needs (a SQLite database's, a TLS file)
        from ..support.failures import describe

        fail(f"{exc.filename}: {exc.strerror}" if exc.filename else describe(exc), 1)
    except Exception as exc:  # the database is away or refused: one line, not a traceback
        if "sqlalchemy" not in sys.modules:  # no database met (mdb send does not load it)
            raise
        from ..state.database import wrapped

        error = wrapped(exc)
        if error is None:
            raise
        fail(f"database: {error}", error.exit_code)


def settings_for(config: Path | None) -> Settings:
    return guarded(lambda: load_settings(config))


def usage_error(message: str) -> NoReturn:
    fail(message, 2)


def print_version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        typer.echo(f"mdb (mdbcontainer) {version('mdbcontainer')}")
        raise typer.Exit()


@app.callback()
def main_options(
    _version: Annotated[
        bool | None,
        typer.Option("--version", callback=print_version, is_eager=True,
                     help="Print the version and exit."),
    ] = None,
) -> None:
    """Run and operate message-driven handlers behind listener ports."""


# -- run and check -------------------------------------------------------------


@app.command(cls=Command)
def run(
    config: ConfigOption = None,
    port: Annotated[
        list[str] | None, typer.Option("--port", metavar="NAME", help="Run only this port (repeatable).")
    ] = None,
    processes: Annotated[
        int | None,
        typer.Option("--processes", metavar="N", min=1, max=64,
                     help="Run N container processes under one supervisor (default: "
                          "container.processes, 1: no supervisor)."),
    ] = None,
    supervisor: Annotated[int | None, typer.Option("--supervisor", hidden=True)] = None,
    process_index: Annotated[int | None, typer.Option("--process-index", hidden=True)] = None,
    report_fd: Annotated[int | None, typer.Option("--report-fd", hidden=True)] = None,
) -> None:
    """Run the container: every port of the settings, or only the named ones."""
    from ..runtime.container import Container

    settings = settings_for(config)
    if supervisor is not None:  # one of the N processes of a supervisor (supervisor.py)
        from ..runtime.supervisor import run_supervised

        setup_logging(settings.container, process_index)
        raise typer.Exit(guarded(lambda: run_supervised(settings, port, supervisor, report_fd)))
    setup_logging(settings.container)
    refuse_wrong_logins(settings)
    count = processes or settings.container.processes
    if count > 1:
        from ..runtime.supervisor import Supervisor

        supervisor_of = guarded(lambda: Supervisor(settings, count, port))
        raise typer.Exit(guarded(supervisor_of.run))
    container = guarded(lambda: Container(settings, ports=port))
    leave(guarded(container.run))


def leave(code: int) -> NoReturn:
    """End ``mdb run`` now that the container has stopped, without the interpreter's teardown.

    Every port has stopped and its threads are joined by the time the container's run
    returns; what is left is the interpreter freeing a process's worth of objects (SQLAlchemy,
    pydantic, kombu), a fifth of a second on an idle machine and more on a busy one, paid by
    every stop and every restart of a container. The exit handlers still run (a tracing
    exporter flushes in one) and the logs are flushed; a thread that is not a daemon (none of
    the container's is) gets the ordinary exit, which waits for it, and so does a process
    that is not ``mdb`` itself (a test calling :func:`main` in its own process).
    """
    own = Path(sys.argv[0]).name in ("mdb", "__main__.py")
    if not own or any(t.is_alive() and not t.daemon for t in threading.enumerate()
                      if t is not threading.main_thread()):
        raise typer.Exit(code)
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with suppress(Exception):
            stream.flush()
    os._exit(code)


def refuse_wrong_logins(settings: Settings) -> None:
    """Exit 2 on a database or broker that refuses the settings; one that is down is waited for."""
    from ..operations.check import verify_services

    guarded(lambda: verify_services(settings))


@app.command(cls=Command)
def check(config: ConfigOption = None) -> None:
    """Validate the settings, import the listeners, connect to the broker and the database;
    warn about risky poison-message settings."""
    from ..handlers.binding import bind
    from ..operations.check import verify_services, warnings_for
    from ..pipeline.acknowledge import check_mode
    from ..state.metadata import load_metadata
    from ..wire.connection import Broker

    settings = settings_for(config)
    bindings = guarded(lambda: bind(settings))
    guarded(lambda: load_metadata(settings))
    caps = guarded(lambda: Broker(settings)).capabilities  # tracing on needs its extra
    for binding in bindings:
        guarded(partial(check_mode, settings.source, binding.name, binding.settings.acknowledge, caps))
    if settings.container.processes > 1:  # what the supervisor refuses (a durable port, metrics ports)
        from ..runtime.supervisor import validate

        guarded(lambda: validate(settings, None, settings.container.processes))
    warnings = warnings_for(settings, bindings) + guarded(lambda: verify_services(settings))
    for line in warnings:
        typer.echo(f"warning: {line}", err=True)
    typer.echo(
        f"{settings.source}: ok: {len(bindings)} port(s) "
        f"({', '.join(b.name for b in bindings)}); broker {mask_url(settings.container.broker_url)}; "
        f"database {mask_url(settings.container.database_url)}"
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
        except UnicodeDecodeError as exc:
            usage_error(f"BODY {source}: not UTF-8 ({exc.reason} at byte {exc.start}); "
                        "a body file holds JSON text")
    try:
        return json.loads(text)
    except ValueError as exc:
        usage_error(f"{source} is not JSON ({exc}); quote text as a JSON string: '\"text\"'")


def parse_lines(text: str) -> list[Any]:
    """``@FILE --lines``: one JSON body per line (JSON Lines); blank lines are skipped.

    Every line is read before anything is sent, so a bad line sends nothing.
    """
    if not text.startswith("@"):
        usage_error("--lines reads a file: give BODY as @FILE (one JSON body per line)")
    source = text[1:]
    try:
        lines = Path(source).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        usage_error(f"BODY {source}: cannot read: {exc.strerror}")
    except UnicodeDecodeError as exc:
        usage_error(f"BODY {source}: not UTF-8 ({exc.reason} at byte {exc.start})")
    bodies = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            bodies.append(json.loads(line))
        except ValueError as exc:
            usage_error(f"{source}:{number} is not JSON ({exc}); nothing was sent")
    if not bodies:
        usage_error(f"BODY {source}: no JSON lines to send")
    return bodies


def positive_seconds(option: str, text: str) -> float:
    """A duration option (``30s``, ``500ms``) as seconds; bad usage unless it is positive."""
    from ..settings import parse_duration

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


@app.command(cls=Command)
def send(
    destination: DestArgument,
    body: BodyArgument,
    config: ConfigOption = None,
    priority: Annotated[
        int | None, typer.Option(metavar="N", help="Priority 0-9 (default 4).", min=0, max=9)
    ] = None,
    ttl: Annotated[
        str | None, typer.Option(metavar="DURATION", help="Time to live, e.g. 30s (default: none).")
    ] = None,
    non_persistent: Annotated[
        bool, typer.Option("--non-persistent", help="Keep it in memory only (default: persistent).")
    ] = False,
    message_id: Annotated[
        str | None, typer.Option("--id", metavar="ID", help="Message id (default: a new uuid).")
    ] = None,
    header: Annotated[
        list[str] | None,
        typer.Option("-H", "--header", metavar="KEY=VALUE", help="A header (repeatable)."),
    ] = None,
    reply_to: Annotated[
        str | None, typer.Option("--reply-to", metavar="QUEUE", help="Where the reply should go.")
    ] = None,
    correlation_id: Annotated[
        str | None,
        typer.Option("--correlation-id", metavar="ID",
                     help="Correlation id, to match a reply to its request (default: none)."),
    ] = None,
    count: Annotated[
        int, typer.Option(metavar="N", min=1,
                          help="Send N copies of the same body (ids ID-1..ID-N with --id).")
    ] = 1,
    lines: Annotated[
        bool, typer.Option("--lines", help="BODY is @FILE of JSON Lines: one message per line "
                                            "(ids ID-1..ID-N with --id).")
    ] = False,
) -> None:
    """Send a message (confirmed by the broker), or one per line of a file; print each id."""
    from ..sending.producer import Producer

    if lines and count > 1:
        usage_error("--lines sends one message per line; --count copies one body: choose one")
    bodies = parse_lines(body) if lines else [parse_body(body)] * count
    headers = parse_headers(header or [])
    if ttl is not None:
        positive_seconds("--ttl", ttl)
    settings = settings_for(config)

    def go() -> None:
        with Producer.from_settings(settings) as producer:
            for n, data in enumerate(bodies):
                mid = message_id if len(bodies) == 1 or not message_id else f"{message_id}-{n + 1}"
                sent = producer.send(
                    destination, data, priority=priority, ttl=ttl, persistent=not non_persistent,
                    headers=headers, message_id=mid, reply_to=reply_to,
                    correlation_id=correlation_id,
                )
                typer.echo(sent)

    guarded(go)


# -- operating ---------------------------------------------------------------------


@app.command(cls=Command)
def ports(
    config: ConfigOption = None,
    as_json: JsonOption = False,
    watch: Annotated[
        bool, typer.Option("--watch", help="A live table, redrawn every second, until Ctrl-C.")
    ] = False,
    iterations: Annotated[int | None, typer.Option(hidden=True, min=1)] = None,
) -> None:
    """Every port of every running container: state, reason, counts (each since its container started)."""
    from ..operations import ports as operate
    from .output import print_ports

    if watch and as_json:
        usage_error("--watch draws a live table; for scripts, poll mdb ports --json instead")
    if watch:
        try:
            watched = settings_for(config)
            from .watch import watch as watch_ports

            guarded(lambda: watch_ports(watched, iterations))
        except KeyboardInterrupt:  # Ctrl-C before the first draw leaves as it does after: exit 0
            pass
        return
    settings = settings_for(config)
    print_ports(guarded(lambda: operate.live_ports(settings)), as_json)
    if not as_json:  # --json stays one document: the list of ports (mdb outbox --json for this)
        from .output import print_outbox

        print_outbox(guarded(lambda: operate.outbox_waiting(settings)), False)


@app.command(cls=Command)
def outbox(config: ConfigOption = None, as_json: JsonOption = False) -> None:
    """The sends waiting in the outbox for the relay, and how long the oldest has waited."""
    from ..operations.ports import outbox_waiting
    from .output import print_outbox

    settings = settings_for(config)
    print_outbox(guarded(lambda: outbox_waiting(settings)), as_json)


@app.command(cls=Command)
def relay(config: ConfigOption = None) -> None:
    """Relay the outbox (sends of Outbox.send) for a service that runs no ports, until SIGTERM."""
    from ..runtime.relay import run_relay

    settings = settings_for(config)
    setup_logging(settings.container)
    refuse_wrong_logins(settings)
    raise typer.Exit(guarded(lambda: run_relay(settings)))


PortArgument = Annotated[
    str, typer.Argument(metavar="NAME", help="A listener port: a [ports.NAME] table or @message_driven name.")
]


@port_app.command("start", cls=Command)
def port_start(name: PortArgument, config: ConfigOption = None, as_json: JsonOption = False) -> None:
    """Start port NAME in every running container (and for containers started later)."""
    from ..operations.ports import switch_port
    from .output import print_port_request

    settings = settings_for(config)
    print_port_request(guarded(lambda: switch_port(settings, name, "started")), as_json)


@port_app.command("stop", cls=Command)
def port_stop(name: PortArgument, config: ConfigOption = None, as_json: JsonOption = False) -> None:
    """Stop port NAME in every running container (and for containers started later)."""
    from ..operations.ports import switch_port
    from .output import print_port_request

    settings = settings_for(config)
    print_port_request(guarded(lambda: switch_port(settings, name, "stopped")), as_json)


@port_app.command("release", cls=Command)
def port_release(
    name: PortArgument,
    key: Annotated[str, typer.Argument(metavar="KEY", help="The held key, as mdb ports shows it.")],
    config: ConfigOption = None,
    as_json: JsonOption = False,
) -> None:
    """Release KEY of ordered port NAME: its waiting messages go on in every running container."""
    from ..operations.ports import release_key
    from .output import print_key_release

    settings = settings_for(config)
    release = guarded(lambda: release_key(settings, name, key))
    if not release.released:
        fail(f"port {name}: key {key!r} is not held")
    print_key_release(release, as_json)


@dedup_app.command("purge", cls=Command)
def dedup_purge(
    config: ConfigOption = None,
    older_than: Annotated[
        str | None,
        typer.Option("--older-than", metavar="DURATION", help="e.g. 7d (default: dedup_retention)."),
    ] = None,
    as_json: JsonOption = False,
) -> None:
    """Delete dedup rows past retention, in short batches."""
    from ..operations.ports import purge_dedup
    from .output import print_dedup_purge

    settings = settings_for(config)
    print_dedup_purge(guarded(lambda: purge_dedup(settings, older_than)), as_json)


# -- backout queues ---------------------------------------------------------------

QueueArgument = Annotated[
    str | None, typer.Argument(metavar="QUEUE", help="The older spelling of --queue QUEUE.")
]
AllOption = Annotated[bool, typer.Option("--all", help="Every message of the queue(s).")]
ToOption = Annotated[
    str | None,
    typer.Option("--to", metavar="DEST", help="Destination (default: the original destination)."),
]
DEAD_LETTER = "container.dead_letter_queue"
EVERY_BACKOUT_QUEUE = "every backout queue of the settings"


def queue_help(default: str) -> Any:
    """``--queue QUEUE`` with the default the command uses in its help."""
    return typer.Option("--queue", metavar="QUEUE", help=f"A backout queue (default: {default}).")


def one_queue(positional: str | None, option: str | None) -> str | None:
    """``dlq list QUEUE`` is the older spelling of ``dlq list --queue QUEUE``: take either, not two."""
    if positional and option and positional != option:
        usage_error(f"QUEUE {positional!r} and --queue {option!r}: name the queue once")
    return option or positional


@dlq_app.command("list", cls=Command)
def dlq_list(
    positional: QueueArgument = None,
    queue: Annotated[str | None, queue_help(DEAD_LETTER)] = None,
    config: ConfigOption = None,
    as_json: JsonOption = False,
    limit: Annotated[
        int, typer.Option(metavar="N", min=0, help="Show the first N messages; 0 shows all.")
    ] = 100,
) -> None:
    """Browse a backout queue without consuming: every message stays, in its order."""
    from ..operations.dlq import browse_page
    from .output import print_dlq_list

    chosen = one_queue(positional, queue)
    settings = settings_for(config)
    name = chosen or settings.container.dead_letter_queue
    letters, total = guarded(lambda: browse_page(settings, name, limit or None))
    print_dlq_list(name, letters, total, as_json)


@dlq_app.command("show", cls=Command)
def dlq_show(
    message_id: Annotated[str, typer.Argument(metavar="ID", help="The message id.")],
    queue: Annotated[str | None, queue_help(EVERY_BACKOUT_QUEUE)] = None,
    config: ConfigOption = None,
    as_json: JsonOption = False,
    full: Annotated[
        bool, typer.Option("--full", help="The whole body (default: its first 2000 characters).")
    ] = False,
) -> None:
    """One message of a backout queue with all its headers and the full exception."""
    from ..operations.dlq import find
    from .output import print_dlq_show

    settings = settings_for(config)
    print_dlq_show(guarded(lambda: find(settings, message_id, queue)), as_json, full)


@dlq_app.command("replay", cls=Command)
def dlq_replay(
    ids: Annotated[list[str] | None, typer.Argument(metavar="ID", help="Message ids.")] = None,
    replay_all: AllOption = False,
    queue: Annotated[str | None, queue_help(EVERY_BACKOUT_QUEUE)] = None,
    to: ToOption = None,
    config: ConfigOption = None,
) -> None:
    """Move messages back to their original destination (or --to), redelivery count reset."""
    from ..operations.dlq import replay_recorded
    from .output import print_replay

    if bool(ids) == replay_all:
        usage_error("give the message IDs to replay, or --all (not both)")
    settings = settings_for(config)
    result = guarded(lambda: replay_recorded(settings, ids or [], replay_all, queue, to))
    guarded(lambda: print_replay(settings, result, queue, to))


@dlq_app.command("purge", cls=Command)
def dlq_purge(
    positional: QueueArgument = None,
    queue: Annotated[str | None, queue_help(DEAD_LETTER)] = None,
    config: ConfigOption = None,
    yes: Annotated[bool, typer.Option("--yes", help="Confirm: delete them all.")] = False,
) -> None:
    """Empty a backout queue (needs --yes)."""
    from ..operations.dlq import purge_recorded

    name = one_queue(positional, queue)
    settings = settings_for(config)
    if not yes:
        name = name or settings.container.dead_letter_queue
        usage_error(f"purge deletes every message on {name}: add --yes to confirm")
    purged, count = guarded(lambda: purge_recorded(settings, name))
    typer.echo(f"purged {count} message(s) from {purged}")


@app.command(cls=Command)
def console(
    config: ConfigOption = None,
    bind: Annotated[
        str | None,
        typer.Option("--bind", metavar="ADDRESS",
                     help="HOST:PORT to serve (default: console.bind, 127.0.0.1:8089; any other "
                          "host needs console.token)."),
    ] = None,
) -> None:
    """Serve the operators' web page: ports, backout queues, history (needs mdbcontainer[console])."""
    try:
        from ..console import serve
    except ImportError as exc:  # the optional extra is not installed
        fail(f"mdb console needs {exc.name or 'its libraries'}: pip install 'mdbcontainer[console]'", 2)
    settings = settings_for(config)
    setup_logging(settings.container)
    raise typer.Exit(guarded(lambda: serve(settings, bind)))


# -- request/reply and durable subscriptions (README: JMS reliability mechanisms) ---


@app.command(cls=Command)
def request(
    destination: DestArgument,
    body: BodyArgument,
    config: ConfigOption = None,
    timeout: Annotated[
        str, typer.Option(metavar="DURATION", help="How long to wait for the reply.")
    ] = "10s",
) -> None:
    """Send with a temporary reply queue; print the reply's body as JSON on stdout."""
    from ..sending.producer import Producer

    data = parse_body(body)
    seconds = positive_seconds("--timeout", timeout)
    settings = settings_for(config)

    def go() -> None:
        with Producer.from_settings(settings) as producer:
            reply = producer.request(destination, data, timeout=seconds)
        typer.echo(json.dumps(reply.body))

    guarded(go)


@app.command(cls=Command)
def unsubscribe(
    client_id: Annotated[
        str, typer.Argument(metavar="CLIENT_ID", help="The subscription's client_id.")
    ],
    subscription: Annotated[str, typer.Argument(metavar="SUBSCRIPTION", help="Its subscription name.")],
    config: ConfigOption = None,
) -> None:
    """Delete a durable subscription and what it holds (refused while a port consumes it)."""
    from ..operations.unsubscribe import unsubscribe as delete_subscription
    from ..wire.connection import Broker

    settings = settings_for(config)
    dropped = guarded(lambda: delete_subscription(Broker(settings), client_id, subscription))
    typer.echo(f"deleted durable subscription {client_id}.{subscription} "
               f"({dropped} message(s) discarded)")


def main() -> None:
    """Console entry point: click's usage errors, too, become one line (exit 2)."""
    try:
        code = app(standalone_mode=False, prog_name="mdb")
    except NoArgsIsHelpError as exc:  # ``mdb dlq``: the group's help, on stdout
        typer.echo(exc.format_message())
        code = exc.exit_code
    except ClickException as exc:
        context = getattr(exc, "ctx", None)
        hint = f" (see {context.command_path} -h)" if context else ""
        one_line = " ".join(exc.format_message().split())
        typer.echo(f"mdb: error: {one_line}{hint}", err=True)
        code = exc.exit_code
    except (typer.Abort, KeyboardInterrupt):
        code = 130
    except Exception as exc:  # a bug: still one line, the traceback on request
        if os.environ.get("MDB_TRACEBACK"):
            raise
        typer.echo(f"mdb: error: unexpected {type(exc).__name__}: {mask_url(str(exc))} "
                   "(a bug; MDB_TRACEBACK=1 shows where)", err=True)
        code = 1
    sys.exit(code if isinstance(code, int) else 0)
