"""``TestContainer``: the real container in the test's own process, with a clock the test moves.

The handlers, ports, pipeline, units of work, dedup, outbox, backout and
Maximum retries are the ones ``mdb run`` runs: a :class:`Container` starts in
this process, on the embedded broker and SQLite in a temporary folder (or on
the RabbitMQ a URL names). What a test would otherwise wait for or kill a
process to see, it asks for: :meth:`TestContainer.drain` waits until nothing
is left to do, :meth:`TestContainer.advance` moves the container's clock
(``support/clock.py``) so that redelivery delays and linger pass without
sleeping, and :meth:`TestContainer.crash` makes the next delivery that
reaches a crash point (``support/crash.py``) end as a killed process would,
then brings the container back.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
import time
import tomllib
import uuid
from collections import Counter
from contextlib import suppress
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..message import InvalidBody, Message, accepted, decode_body, from_epoch
from ..runtime.container import Container, in_flight
from ..sending.producer import Producer
from ..settings import Settings, parse_duration, settings_from_dict
from ..settings.loading import apply_env, resolve_paths, settings_path
from ..support import clock, crash
from ..wire.connection import Broker
from ..wire.delays import wait_queues
from ..wire.delivery import Delivery
from ..wire.headers import FAILED_AT, WAIT_EXPIRES_AT, WAITED
from ..wire.publisher import Publisher
from ..wire.queues import QueueSession
from .report import Failures

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from ..runtime.port import ListenerPort

#: The environment variable that points every TestContainer without a broker URL at a RabbitMQ.
BROKER_ENV = "MDB_TEST_BROKER_URL"
_POLL = 0.005  # seconds between two looks at the container while draining
# Without an unacknowledged count (RabbitMQ), a consumer must come back from one idle read of
# its connection, begun after everything looked settled, before drain believes it.
_IDLE_READ = 0.05
# Where the broker counts them (the embedded one), no read is waited for: the idle read only
# bounds how long a stopping consumer takes to see the stop (a test's end waits for it).
_IDLE_READ_COUNTED = 0.01
# What a delivery can end in, once and for all (``failed`` comes back, waits, or stops the port).
_FINAL = ("handled", "duplicate_skipped", "backed_out", "invalid_body", "expired")
_POLL_BROKER = 0.005  # the embedded transport's poll of an empty queue (its own default: 50 ms)


class PortState(str):
    """A port's state (``"started"``, ``"stopped"``...), compared as the string; more as attributes."""

    reason: str
    consecutive_failures: int

    def __new__(cls, state: str, reason: str = "", consecutive_failures: int = 0) -> PortState:
        made = super().__new__(cls, state)
        made.reason = reason
        made.consecutive_failures = consecutive_failures
        return made


class TestContainer:
    """The container of a settings file, run in this process for a test (``with`` it).

    Args:
        settings: a settings file (default: ``$MDB_SETTINGS``, then ``./settings.toml``), or the
            settings as a dict of TOML tables, or a loaded :class:`~mdbcontainer.Settings`.
        ports: the ports to run (default: every port of the settings).
        listeners: listener modules to import instead of the settings' ``container.listeners``.
        broker_url: a broker to use instead of the embedded one in a temporary folder
            (default: ``$MDB_TEST_BROKER_URL`` when set). On RabbitMQ the ports' queues and
            backout queues are purged at start: give the kit a broker (or vhost) of its own.
        database_url: a database instead of SQLite in the temporary folder.
    """

    __test__ = False  # a class named Test... that pytest must not collect

    def __init__(self, settings: str | os.PathLike[str] | dict[str, Any] | Settings | None = None, *,
                 ports: list[str] | None = None, listeners: list[str] | None = None,
                 broker_url: str | None = None, database_url: str | None = None) -> None:
        self._source = settings
        self._ports = ports
        self._listeners = listeners
        self._broker_url = broker_url or os.environ.get(BROKER_ENV) or None
        self._database_url = database_url
        self._folder: Path | None = None
        self._container: Container | None = None
        self._retired: dict[str, Counter[str]] = {}  # outcomes counted by containers that were killed
        self._crashed: str | None = None  # the crash point the running container died at
        self._ever_crashed = False
        self._sent_to: Counter[str] = Counter()  # messages this kit sent to each queue
        self._kept: dict[str, list[Message]] = {}  # what the spies took off their topics
        self._spies: dict[str, str] = {}  # topic -> the kit's subscription queue on it
        self._queues: QueueSession | None = None
        self._producer: Producer | None = None
        self.failures = Failures()
        self.settings: Settings | None = None

    # -- lifecycle -----------------------------------------------------------

    def __enter__(self) -> TestContainer:
        self.start()
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.close()
        if exc_type is not None and self.failures:
            print(self.failures.report(), file=sys.stderr)  # pytest shows it with the failure

    def start(self) -> TestContainer:
        """Build the settings, start the container and wait until its ports consume."""
        self._folder = Path(tempfile.mkdtemp(prefix="mdb-test-", dir=_scratch()))
        self.settings = self._build_settings(self._folder)
        if self._database_url is None:  # the kit's own SQLite: its tables from the template
            shutil.copyfile(_template(self.settings), self._folder / "container.db")
        broker = Broker(self.settings)
        self._queues = QueueSession(broker)
        self._producer = Producer(self.settings, broker)
        self.failures.attach()
        try:
            self._spy_on_topics()
            self._start_container(purge=not broker.capabilities.local_file)
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Stop the container (gracefully), drop the spies, reset the clock and crash points."""
        crash.disarm()
        container, self._container = self._container, None
        if container is not None:
            container.stop(timeout=10)
            container.store.dispose()
        if self._queues is not None:
            for queue in self._spies.values():
                with suppress(Exception):
                    self._queues.delete_if_unused(queue)
            self._queues.close()
            self._queues = None
        if self._producer is not None:
            self._producer.close()
            self._producer = None
        self.failures.detach()
        clock.reset()
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None

    @property
    def container(self) -> Container:
        """The running :class:`Container` (a new one after each :meth:`crash`)."""
        if self._container is None:
            raise RuntimeError("the TestContainer is not running: use it in a with block")
        return self._container

    def _build_settings(self, folder: Path) -> Settings:
        source = self._source
        if isinstance(source, Settings):
            base: dict[str, Any] = source.model_dump(mode="json", exclude_unset=True, by_alias=True)
            origin, home = "<settings>", Path.cwd()
        elif isinstance(source, dict):
            base, origin, home = dict(source), "<settings>", Path.cwd()
        else:
            file = settings_path(source)
            base = apply_env(tomllib.loads(file.read_text(encoding="utf-8")), dict(os.environ), {})
            origin, home = str(file), Path(os.path.abspath(file)).parent
        container = dict(base.get("container") or {})
        container["broker_url"] = self._broker_url or f"embedded://{folder / 'broker.db'}"
        container["database_url"] = self._database_url or f"sqlite:///{folder / 'container.db'}"
        container.pop("metrics_port", None)  # no HTTP server: tests run side by side
        if self._listeners is not None:
            container["listeners"] = list(self._listeners)
        settings = settings_from_dict({**base, "container": container}, source=origin)
        return settings.model_copy(update={"container": resolve_paths(settings.container, home)})

    def _start_container(self, *, purge: bool = False) -> None:
        assert self.settings is not None
        if str(Path.cwd()) not in sys.path:  # listener modules beside the test, as mdb run finds them
            sys.path.insert(0, str(Path.cwd()))
        container = Container(self.settings, ports=self._ports)
        self._container = container
        container.broker.polling_interval = _POLL_BROKER
        idle = _IDLE_READ_COUNTED if container.broker.capabilities.counts_unacknowledged else _IDLE_READ
        for port in container.ports.values():
            port.idle_read = idle
        if purge:
            self._purge_queues()
        container.start()
        deadline = time.monotonic() + 30.0
        while any(p.state == "starting" for p in container.ports.values()):
            if time.monotonic() > deadline:
                raise AssertionError(f"ports did not start within 30s: {self._states()}")
            time.sleep(_POLL)

    def _purge_queues(self) -> None:
        """On a shared broker, start from empty queues: a message of an earlier run is not this test's."""
        assert self._queues is not None
        for port in self.container.ports.values():
            if port.settings.topic is not None:
                continue  # a subscription's queue is declared by its port, with its binding
            for queue in (port.queue, port.backout_queue):
                with suppress(Exception):
                    self._queues.declare(queue)  # with the settings' arguments, as the port does
                    self._queues.purge(queue)
            for wait in wait_queues(port.queue, port.queue_settings):  # declared by the port
                with suppress(Exception):
                    self._queues.purge(wait)

    def _spy_on_topics(self) -> None:
        assert self._queues is not None and self.settings is not None
        for topic in self.settings.topics:
            self._spies[topic] = self._queues.subscribe(topic, f"mdb-test.{uuid.uuid4().hex[:12]}.{topic}")
            self._kept[topic] = []

    # -- what a test does ----------------------------------------------------

    def send(self, destination: str, body: Any, **options: Any) -> str:
        """Send as ``Producer.send`` does (same options); return the message id."""
        self._recover()
        assert self._producer is not None
        message_id = self._producer.send(destination, body, **options)
        self._sent_to[destination] += 1
        return message_id

    def drain(self, timeout: str | float | timedelta = "10s") -> None:
        """Wait until the running ports' queues are empty, nothing is in flight and the outbox is sent.

        A port that is stopped is not waited for (its messages stay on its queue),
        nor is a message waiting out a redelivery delay: :meth:`advance` the
        clock for it. Raises AssertionError naming the messages and ports still
        busy when that does not happen within ``timeout``.
        """
        limit = _seconds(timeout)
        deadline = time.monotonic() + limit
        quiet_since: float | None = None
        seen = self._delivered()
        while True:
            self._recover()
            busy = self._busy()
            delivered = self._delivered()
            if busy or delivered != seen:
                quiet_since, seen = None, delivered
            elif not self._outbox_left():
                quiet_since = quiet_since or time.monotonic()
                if self._believed(quiet_since):
                    return
            if time.monotonic() > deadline:
                raise AssertionError(f"drain did not settle within {limit:g}s: "
                                     f"{'; '.join(busy) or 'the consumers are still reading'}"
                                     f"{self.failures.summary()}")
            time.sleep(_POLL)

    def outcomes(self, port: str) -> dict[str, int]:
        """What became of the port's deliveries so far, by outcome (``handled``, ``failed``,
        ``duplicate_skipped``, ``backed_out``, ``invalid_body``, ``expired``), zeros left out."""
        self._recover()
        counted = Counter(self._retired.get(port, Counter()))
        for tally in self._port(port).tallies:
            counted.update(tally.outcomes)
        return {outcome: n for outcome, n in counted.items() if n}

    def sent(self, destination: str) -> list[Message]:
        """The messages sent to a topic of the settings since the start, or waiting on a queue no
        port of this container reads (they stay there)."""
        self._recover()
        assert self._queues is not None
        if destination in self._spies:
            taken = self._queues.take(self._spies[destination])
            self._kept[destination].extend(_from_delivery(d, destination) for d in taken)
            return list(self._kept[destination])
        readers = [p.name for p in self.container.ports.values() if p.queue == destination]
        if readers:
            raise ValueError(f"{destination!r} is read by port {readers[0]}: what reached it is in "
                             f"outcomes({readers[0]!r})")
        return self._browse(destination)

    def backed_out(self, queue: str | None = None) -> list[Message]:
        """The messages on ``queue``, or on every backout queue of the ports, as Message objects
        (the ``x-mdb-*`` headers say why each is there)."""
        self._recover()
        if queue is not None:
            return self._browse(queue)
        queues = dict.fromkeys(p.backout_queue for p in self.container.ports.values())
        return [message for name in queues for message in self._browse(name)]

    def port_state(self, port: str) -> PortState:
        """The port's state as ``mdb ports`` shows it; ``.reason`` says why it stopped."""
        self._recover()
        p = self._port(port)
        return PortState(p.state, p.reason, p.consecutive_failures)

    def session(self) -> Session:
        """A new SQLAlchemy Session on the container's database (``with mdb.session() as s:``)."""
        self._recover()
        from sqlalchemy.orm import Session

        return Session(self.container.store.engine)

    def advance(self, duration: str | float | timedelta) -> None:
        """Move the container's clock on: redelivery delays, expiry and linger pass without sleeping.

        The embedded broker reads the same clock; RabbitMQ cannot, so on it the
        messages whose wait is up by this clock are moved back to their queue
        here, as its dead-lettering would have moved them.
        """
        self._recover()
        clock.advance(_seconds(duration))
        assert self._queues is not None
        if not self._queues.expire_due():
            self._return_waiting()

    def crash(self, at: str = "after-commit", *, port: str | None = None) -> None:
        """The next delivery (of ``port``, or of any port) that reaches crash point ``at`` dies there
        as a killed process would: nothing after it runs. The container then comes back, so a
        :meth:`drain` sees the redelivery and the dedup.

        The points are those of ``MDB_CRASH_AT`` (``support/crash.py``) that a delivery passes:
        ``before-handler``, ``in-handler``, ``after-commit``, ``after-ack``, ``outbox-dispatch``,
        ``mid-backout``, ``before-wait``, ``mid-wait``, and for batches ``before-commit`` and
        ``mid-acks`` (``mid-replay`` belongs to ``mdb dlq replay``).
        """
        if at not in crash.POINTS or at == "mid-replay":
            raise ValueError(f"crash(at={at!r}): not a crash point of a delivery; the points are "
                             f"{', '.join(p for p in crash.POINTS if p != 'mid-replay')}")
        if port is not None and self._port(port).spec.is_async:
            raise ValueError(f"crash(port={port!r}): an async port's crash points are not armed in "
                             "process yet (use ContainerProcess and MDB_CRASH_AT)")
        crash.arm(at, self._die, port=port or "")

    # -- crashes -------------------------------------------------------------

    def _die(self, point: str) -> None:
        """Called on the delivery's thread at the armed point: the process "dies" here."""
        self._crashed = point
        self._ever_crashed = True
        raise crash.Killed(point)

    def _recover(self) -> None:
        """A container that died at a crash point is killed for good and a new one started."""
        if self._crashed is None:
            return
        dead = self.container
        for name, port in dead.ports.items():
            counted = self._retired.setdefault(name, Counter())
            for tally in port.tallies:
                counted.update(tally.outcomes)
        dead.kill()
        self._crashed = None
        self._start_container()

    # -- settling ------------------------------------------------------------

    def _busy(self) -> list[str]:
        """What keeps drain waiting: a running port's messages and deliveries, in words."""
        assert self._queues is not None
        busy = []
        for port in self.container.ports.values():
            if port.stopping:
                continue  # a stopped port consumes nothing more: its queue is no work in progress
            if port.state != "started":
                busy.append(f"port {port.name} {port.state}")
                continue
            flying = in_flight(port)
            left = self._queues.outstanding(port.queue)
            if left is None:
                left = self._queues.status(port.queue).messages + flying
            if left or flying:
                running = [m for c in port.consumers for m in c.running.message_ids]
                named = f" (in a handler: {', '.join(running)})" if running else ""
                busy.append(f"port {port.name}: {left} message(s) on {port.queue}{named}")
            elif unsettled := self._unsettled(port):
                busy.append(f"port {port.name}: {unsettled} message(s) sent to {port.queue} not settled")
        return busy

    def _unsettled(self, port: ListenerPort) -> int:
        """Where the broker cannot count unacknowledged messages: this kit's sends to the port's
        queue that have no final outcome yet and are not waiting out a delay (a requeue the broker
        has not yet taken back shows on no count). After a crash an acknowledgment may have had no
        outcome counted: then the consumers' quiet is the only evidence (:meth:`_believed`)."""
        assert self._queues is not None
        if self.container.broker.capabilities.counts_unacknowledged or self._ever_crashed:
            return 0
        sent = self._sent_to.get(port.queue, 0)
        if not sent:
            return 0
        outcomes = self.outcomes(port.name)
        final = sum(outcomes.get(o, 0) for o in _FINAL)
        waiting = sum(status.messages for wait in wait_queues(port.queue, port.queue_settings)
                      if (status := self._queues.find(wait)) is not None)
        return max(0, sent - final - waiting)

    def _believed(self, quiet_since: float) -> bool:
        """Settled: at once where the broker counts unacknowledged messages (the embedded one);
        elsewhere once every consumer has read its connection for a whole idle read, begun after
        all looked quiet, and got nothing (a message the broker had sent was in that read)."""
        if self.container.broker.capabilities.counts_unacknowledged:
            return True
        consumers = [c for p in self.container.ports.values() if not p.stopping for c in p.consumers]
        settled_at = quiet_since + _IDLE_READ
        return all(c.alive_at > settled_at for c in consumers) and (
            time.monotonic() > settled_at + _IDLE_READ or not consumers)

    def _delivered(self) -> int:
        """Every outcome the running container counted so far: a change means work went on."""
        return sum(sum(t.outcomes.values()) for p in self.container.ports.values() for t in p.tallies)

    def _outbox_left(self) -> bool:
        """Sends committed but not published (a crash after the commit): relayed now, as the
        relay would after its grace (the process that wrote them is gone or done with them)."""
        resources = self.container.resources
        if not resources.outbox.backlog():
            return False
        publisher = Publisher(self.container.broker)
        try:
            resources.outbox.relay(publisher, grace=timedelta(0))
        finally:
            publisher.close()
        return True

    # -- reading queues ------------------------------------------------------

    def _browse(self, queue: str) -> list[Message]:
        assert self.settings is not None
        with QueueSession(self.container.broker) as queues:  # RabbitMQ hands back at close
            if not queues.exists(queue):
                return []
            browsed, _count = queues.browse(queue)
        return [_message(b.properties, b.headers, b.body, b.content_type, queue) for b in browsed]

    def _return_waiting(self) -> None:
        """RabbitMQ's wait queues, by this clock: what is due goes back to its queue."""
        assert self.settings is not None
        now = clock.now()
        publisher = Publisher(self.container.broker)
        try:
            for port in self.container.ports.values():
                for wait in wait_queues(port.queue, port.queue_settings):
                    self._move_due(publisher, wait, port.queue, now)
        finally:
            publisher.close()

    def _move_due(self, publisher: Publisher, wait: str, queue: str, now: Any) -> None:
        with QueueSession(self.container.broker) as queues:
            if not queues.exists(wait):
                return
            held = queues.hold(wait)
            for delivery in held.take_all():
                if _due_at(delivery) <= now:
                    out = delivery.copy_to(queue, {}, replace=False)
                    publisher.publish(exchange="", routing_key=queue, body=out.body,
                                      properties=out.properties, mandatory=True)
                    held.remove(delivery)

    # -- helpers -------------------------------------------------------------

    def _port(self, name: str) -> ListenerPort:
        ports = self.container.ports
        if name not in ports:
            raise KeyError(f"no port {name!r} in this TestContainer; its ports: {', '.join(ports)}")
        return ports[name]

    def _states(self) -> str:
        return ", ".join(f"{p.name} {p.state} {p.reason}".strip() for p in self.container.ports.values())


_TEMPLATES: dict[tuple[str, str | None, str | None], Path] = {}


def _template(settings: Settings) -> Path:
    """An SQLite file holding the container's and the application's tables and no rows, made once
    per process for each table layout: a test's database starts as its copy, instead of paying
    for the DDL of a dozen tables at every start (the container then finds them all there)."""
    from ..state.metadata import create_missing, load_metadata
    from ..state.store import Store

    c = settings.container
    key = (c.table_prefix, c.db_schema, c.metadata)
    if key not in _TEMPLATES:
        folder = Path(tempfile.mkdtemp(prefix="mdb-template-", dir=_scratch()))
        atexit.register(shutil.rmtree, folder, True)
        path = folder / "container.db"
        store = Store(c.model_copy(update={"database_url": f"sqlite:///{path}"}))
        try:
            store.create_tables()
            metadata = load_metadata(settings)
            if metadata is not None:
                create_missing(metadata, store.engine)
        finally:
            store.dispose()
        _TEMPLATES[key] = path
    return _TEMPLATES[key]


def _scratch() -> str | None:
    """Where the temporary broker and database go: memory-backed ``/dev/shm`` where there is one
    (a commit's fsync costs nothing there, and a test's files need not outlive it), else $TMPDIR."""
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None


def _seconds(value: str | float | timedelta) -> float:
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, int | float):
        return float(value)
    return parse_duration(value).total_seconds()


def _due_at(delivery: Delivery) -> Any:
    """When a message on a wait queue is due back: when it failed plus its wait, or its expiry."""
    from datetime import datetime

    failed_at = datetime.fromisoformat(str(delivery.header(FAILED_AT)))
    due = failed_at + parse_duration(str(delivery.header(WAITED)))
    expires = delivery.header(WAIT_EXPIRES_AT)
    if expires:
        due = min(due, datetime.fromisoformat(str(expires)) + timedelta(milliseconds=1100))
    return due


def _from_delivery(delivery: Delivery, destination: str) -> Message:
    props = {k: v for k, v in delivery.properties.items()
             if k not in ("application_headers", "delivery_info", "delivery_tag")}
    return _message(props, delivery.headers, delivery.body, delivery.content_type, destination)


def _message(properties: dict[str, Any], headers: dict[str, Any], body: bytes, content_type: str,
             destination: str) -> Message:
    """A message as a test reads it: the body decoded (JSON or text; other types stay bytes)."""
    try:
        decoded = decode_body(body, content_type, accepted([content_type]), len(body),
                              properties.get("content_encoding"))
    except InvalidBody:  # an invalid body backed out: the test sees it as it came
        decoded = body
    expiration = properties.get("expiration")
    stamp = from_epoch(properties.get("timestamp"))
    expires = stamp + timedelta(milliseconds=int(expiration)) if stamp and expiration else None
    return Message(
        id=str(properties.get("message_id") or ""), body=decoded, headers=dict(headers or {}),
        priority=int(properties.get("priority") or 0), expires_at=expires,
        persistent=properties.get("delivery_mode") == 2, reply_to=properties.get("reply_to"),
        correlation_id=properties.get("correlation_id"), timestamp=stamp, destination=destination,
        content_type=content_type, raw=body)

