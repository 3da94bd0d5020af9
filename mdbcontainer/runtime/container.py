"""The container: binds handlers to listener ports from the settings, runs and stops them.

``Container(settings).run()`` is what ``mdb run`` does: import the listener
modules, create the container's tables, start every port the fleet wants
started, then poll the fleet's port switches, publish heartbeats, relay the
outbox and purge old dedup rows until SIGTERM or SIGINT.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import tenacity

from ..errors import SettingsError
from ..handlers.binding import Binding, bind
from ..pipeline.resources import SharedResources
from ..settings import Settings
from ..state.control import STOPPED_BY_OPERATOR, Wanted
from ..state.database import database_refused, is_infrastructure
from ..state.metadata import create_missing, load_metadata
from ..state.store import Store
from ..support.failures import describe
from ..support.logs import fields
from ..support.retry import DEFAULT as RETRY
from ..wire.connection import Broker
from ..wire.delays import wait_queues
from ..wire.publisher import Publisher
from .port import ListenerPort
from .relay import Relay

if TYPE_CHECKING:
    from sqlalchemy import MetaData

    from .endpoints import OperationsServer

log = logging.getLogger("mdbcontainer.container")

MEASURE_EVERY = 5.0  # the outbox and wait-queue gauges; or every outbox_relay_grace, when shorter
PURGE_EVERY = 3600.0
SHUTDOWN = "container shutting down"


def in_flight(port: ListenerPort) -> int:
    """The deliveries of ``port`` running now (in a handler or finishing its unit of work)."""
    return sum(c.delivering_since is not None for c in list(port.consumers))


class Container:
    """One container process: its ports, its heartbeat, its housekeeping."""

    def __init__(self, settings: Settings, *, ports: list[str] | None = None) -> None:
        self.settings = settings
        self.bindings = bind(settings, ports)
        self.metadata = load_metadata(settings)
        self.broker = Broker(settings)
        consumers = sum(b.settings.concurrency for b in self.bindings)
        self.store = Store(settings.container, consumers=consumers)  # a connection per consumer
        self.resources = SharedResources(settings, self.store, self.broker)
        self._stop = threading.Event()
        self._changed = threading.Event()  # a port changed state: write the heartbeat now
        self.ports = {b.name: self._port(b) for b in self.bindings}
        self._threads: list[threading.Thread] = []
        self._generations: dict[str, int] = {}
        self._waiting: dict[str, int] = {}  # per port: messages waiting out a redelivery delay
        self.endpoints: OperationsServer | None = None
        for port in self.ports.values():
            self._bind_metrics(port)

    def _port(self, binding: Binding) -> ListenerPort:
        queue = binding.settings.queue_name
        return ListenerPort(
            name=binding.name, settings=binding.settings, spec=binding.spec,
            resources=self.resources, queue_settings=self.settings.queue(queue),
            backout_queue=self.settings.backout_queue_for(queue), on_state_change=self._changed.set,
        )

    def _bind_metrics(self, port: ListenerPort) -> None:
        """The port's gauges read the port at scrape time: nothing to update per delivery."""

        def started() -> bool:
            return port.state == "started"

        def failures() -> int:
            return port.consecutive_failures

        self.resources.metrics.bind_port(port.name, started=started, failures=failures,
                                         in_flight=lambda: in_flight(port),
                                         tallies=lambda: list(port.tallies))

    @property
    def id(self) -> str:
        return self.resources.control.id

    @property
    def threads(self) -> list[threading.Thread]:
        """The container's own background threads (control, housekeeping), for /healthz."""
        return list(self._threads)

    # -- lifecycle ----------------------------------------------------------

    def start(self) -> None:
        """Create tables, register with the fleet, start ports and the background loops."""
        c = self.settings.container
        if c.metrics_port:  # the HTTP server's modules only when it serves
            from .endpoints import OperationsServer

            self.endpoints = OperationsServer(self, c.metrics_host, c.metrics_port)
            self.endpoints.start()
        wanted = self._prepare_database()
        self._sweep_leases()  # before a port consumes: an earlier life's leases are deaths
        for name, port in self.ports.items():
            w = wanted.get(name)
            self._generations[name] = w.generation if w else 0
            if w is not None and w.state == "stopped":
                port.reason = w.reason
                log.warning("port %s stays stopped: %s (mdb port start %s)", name, w.reason, name)
            elif port.settings.autostart:
                port.start()
        published = self._publish_state()  # mdb ports shows it from the moment it logs its start
        self._spawn("mdb-control", lambda: self._control_loop(failing=not published))
        self._spawn("mdb-housekeeping", self._housekeeping_loop)
        self._spawn("mdb-relay", Relay(self.settings, self.resources.outbox, self._stop).run)
        log.info("container %s started: %d port(s) on %s", self.id, len(self.ports),
                 self.broker.masked_url)

    def _spawn(self, name: str, target: Any) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def stop(self, timeout: float | None = None) -> bool:
        """Stop consuming, let in-flight deliveries finish; True when all finished in time."""
        limit = self.settings.container.shutdown_timeout.total_seconds() if timeout is None else timeout
        self.resources.shutting_down = True
        self._stop.set()
        self._changed.set()
        for port in self.ports.values():
            port.stop(SHUTDOWN, logged=True)  # logged below, once its deliveries are done
        deadline = time.monotonic() + limit
        for port in self.ports.values():
            busy = in_flight(port)
            if busy:
                log.info("port %s stopping: waiting for %d in-flight deliver%s", port.name, busy,
                         "y" if busy == 1 else "ies", extra=fields(port=port.name, state="stopping"))
        finished = True
        for port in self.ports.values():
            if port.join(max(0.0, deadline - time.monotonic())):
                log.info("port %s stopped: %s", port.name, SHUTDOWN,
                         extra=fields(port=port.name, state="stopped", reason=SHUTDOWN))
            else:
                finished = False  # warned about below, after the rest is closed
        for thread in self._threads:
            thread.join(1.0)
        if self.endpoints is not None:
            self.endpoints.stop()
        try:
            self.resources.counter.end_leases_of(self.id)
            self.resources.control.deregister()
        except Exception as exc:
            log.warning("could not deregister container %s: %s", self.id, describe(exc))
        if not finished:
            log.warning("some deliveries did not finish within shutdown_timeout; "
                        "they stay unacknowledged and will be redelivered")
        return finished

    def kill(self, timeout: float = 10.0) -> None:
        """End as a SIGKILL would leave it, within this process (``mdbcontainer.testing``'s crash).

        Nothing is acknowledged, handed back or counted; the consumers' leases and
        the container's heartbeat row stay as a dead process leaves them, so the
        container started next finds the evidence of a death, counts the
        deliveries that were outstanding and skips the work that had committed.
        """
        self.resources.killed = self.resources.shutting_down = True
        self._stop.set()
        for port in self.ports.values():
            port.stop_event.set()
        for port in self.ports.values():
            port.join(timeout)
        for thread in self._threads:
            thread.join(timeout)
        if self.endpoints is not None:
            self.endpoints.stop()
        self.store.dispose()

    def _prepare_database(self) -> dict[str, Wanted]:
        """Create tables, register, read the port switches; a database that is away is waited for."""

        def prepare() -> dict[str, Wanted]:
            self.store.create_tables()
            if self.metadata is not None:
                self._create_application_tables(self.metadata)
            self.resources.control.register()
            return self.resources.control.wanted()

        def before_sleep(state: tenacity.RetryCallState) -> None:
            error = state.outcome.exception() if state.outcome else None
            log.warning("database unavailable at start (attempt %d): %s; retrying in %.1fs",
                        state.attempt_number, describe(error), state.upcoming_sleep)

        def outage(exc: BaseException) -> bool:  # a missing database or a wrong login is no outage
            return is_infrastructure(exc) and not database_refused(exc)

        retrying = RETRY.until_stopped(self._stop, retry=tenacity.retry_if_exception(outage),
                                       before_sleep=before_sleep)
        try:
            wanted: dict[str, Wanted] = retrying(prepare)
        except Exception as exc:  # a missing database or a wrong login: the settings, exit 2
            if database_refused(exc):
                raise SettingsError(f"container.database_url: {describe(exc)}") from exc
            raise
        return wanted

    def _create_application_tables(self, metadata: MetaData) -> None:
        """``container.metadata``'s missing tables, and a log line that says which (or none)."""
        created = create_missing(metadata, self.store.engine)
        reference = self.settings.container.metadata
        if created:
            log.info("created %d table(s) of %s: %s", len(created), reference, ", ".join(created))
        else:
            log.info("all %d table(s) of %s exist; none created", len(metadata.tables), reference)

    def request_stop(self) -> None:
        """Stop as the first SIGTERM would (gracefully), without counting as a signal."""
        self._stop.set()

    def run(self, started: Callable[[], None] | None = None) -> int:
        """Run until SIGTERM or SIGINT; a second signal exits at once (nothing was acknowledged early).

        ``started`` is called once the container has started (its supervisor learns
        that an exit from then on is a death to restart, not a refusal of its settings).
        """
        signals = {"count": 0}

        def on_signal(signum: int, _frame: Any) -> None:
            signals["count"] += 1
            if signals["count"] > 1:
                log.warning("second signal: exiting now; unacknowledged messages will be redelivered")
                os._exit(130)
            log.info("signal %s: stopping (again to exit at once)", signal.Signals(signum).name)
            self._stop.set()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        # ``kill -USR1 PID``: every thread's stack on stderr, and the container runs on: what
        # an operator needs to see where a stop or a handler hangs.
        faulthandler.register(signal.SIGUSR1, all_threads=True)
        try:
            self.start()
        except Exception as exc:
            if not (is_infrastructure(exc) and self._stop.is_set()):
                raise
            log.info("stopped before the database came up")
            return 0
        if started is not None:
            started()
        # A signal sets it. Never an untimed wait: a signal the kernel hands to another thread
        # only flags its Python handler, which runs when this (main) thread wakes next; an
        # untimed wait slept through SIGTERM for good.
        while not self._stop.wait(0.5):
            pass
        self.stop()
        log.info("container %s stopped", self.id)
        return 0

    # -- background loops ---------------------------------------------------

    def _control_loop(self, failing: bool = False) -> None:
        """Every ``control_interval``, and at once after a port changed state: switches, heartbeat.

        ``failing``: the heartbeat at start saw the database away. This loop ends
        only the outage it saw: a consumer ends its own.
        """
        interval = self.settings.container.control_interval.total_seconds()
        while True:
            self._changed.wait(interval)
            self._changed.clear()
            if self._stop.is_set():
                return
            for port in self.ports.values():
                port.warn_stuck()
            if not self._publish_state():
                failing = True
            elif failing:
                failing = False
                self.resources.recovered("database")

    def _publish_state(self) -> bool:
        """Apply the fleet's port switches and write the heartbeat; False while the database is away."""
        try:
            self.apply_wanted()
            self.resources.control.heartbeat(self.port_rows())
        except Exception as exc:
            self.resources.outage("database", exc)
            return False
        return True

    def apply_wanted(self) -> None:
        """Start or stop ports as the fleet's switches say (a newer generation wins)."""
        wanted = self.resources.control.wanted()
        for name, port in self.ports.items():
            if port.stopping:
                port.join(0)
            w = wanted.get(name)
            if w is None or w.generation <= self._generations.get(name, 0):
                continue
            if w.state == "started" and (port.stopping or not port.consumers):
                if not port.join(5.0):
                    continue  # a consumer still finishes a delivery: start on a later poll
                self._generations[name] = w.generation
                log.info("port %s: start requested", name)
                port.start()
                continue
            self._generations[name] = w.generation
            if w.state == "stopped" and not port.stopping:
                port.stop(w.reason or STOPPED_BY_OPERATOR)

    def port_rows(self) -> list[dict[str, Any]]:
        rows = []
        for name, port in self.ports.items():
            s = port.stats
            rows.append({
                "port": name, "destination": port.settings.destination or port.settings.topic,
                "queue": port.queue,
                "state": port.state, "reason": port.reason,
                "consecutive_failures": s.consecutive_failures, "delivered": s.delivered,
                "failed": s.failed, "backed_out": s.backed_out, "expired": s.expired,
                "handled": s.handled, "duplicate_skipped": s.duplicate_skipped,
                "invalid_body": s.invalid_body, "since": port.since.isoformat(),
                "batch_size": port.settings.batch_size, "batches": s.batches,
                "batched": s.batched, "fallbacks": s.fallbacks, "waiting": self._waiting.get(name, 0),
                "stuck": [stuck.row() for stuck in port.stuck()],
                **({"order_by": port.settings.order_by, "held": port.held_keys()}
                   if port.settings.order_by else {}),
            })
        return rows

    def _housekeeping_loop(self) -> None:
        publisher = Publisher(self.broker, heartbeat=True)
        last_purge = time.monotonic() - PURGE_EVERY + 60.0
        every = min(MEASURE_EVERY, self.settings.container.outbox_relay_grace.total_seconds())
        try:
            while not self._stop.wait(every):
                self._sweep_leases()
                self._measure_outbox()
                self._measure_waiting(publisher)
                if time.monotonic() - last_purge >= PURGE_EVERY:
                    last_purge = time.monotonic()
                    self.purge()
        finally:
            publisher.close()

    def _sweep_leases(self) -> None:
        """End the leases of dead holders soon after they died (state/counts.py: the evidence of a
        death runs from the holder's last sign of life, not from whenever a redelivery looks)."""
        try:
            self.resources.counter.sweep()
        except Exception as exc:
            log.debug("leases not swept: %s", describe(exc))

    def _measure_outbox(self) -> None:
        """The outbox gauges: one query every few seconds, never per message."""
        try:
            waiting = self.resources.outbox.waiting()
            metrics = self.resources.metrics
            metrics.outbox_backlog.set(waiting.count)
            metrics.outbox_waiting.set(waiting.count)
            metrics.outbox_oldest.set(waiting.oldest_seconds)
        except Exception as exc:
            log.debug("outbox backlog not measured: %s", describe(exc))

    def _measure_waiting(self, publisher: Publisher) -> None:
        """Messages of each port's queue waiting out a redelivery delay: its wait queues' depth."""
        if publisher.broker.capabilities.postpones:  # no wait queues: a delay is the message's own
            return
        for name, port in self.ports.items():
            waits = wait_queues(port.queue, port.queue_settings)
            if not waits:
                continue
            try:
                self._waiting[name] = sum(publisher.depth(queue) or 0 for queue in waits)
                self.resources.metrics.waiting.labels(port=name).set(self._waiting[name])
            except Exception as exc:
                publisher.close()
                log.debug("waiting messages of port %s not measured: %s", name, describe(exc))
                return

    def purge(self) -> int:
        try:
            removed = self.resources.dedup.purge(self.settings.container.dedup_retention)
        except Exception as exc:
            log.warning("dedup purge will retry: %s", describe(exc))
            return 0
        if removed:
            self.resources.metrics.dedup_purged.inc(removed)
            log.info("dedup purge removed %d row(s) past retention", removed)
        return removed
