"""The outbox relay: publishes what the outbox holds, one relay at a time across the fleet.

Every ``mdb run`` runs one on a thread of its own (``mdb-relay``) and ``mdb
relay`` runs one alone, for a service that runs no ports (a web application
that sends through :meth:`Outbox.send`). On PostgreSQL one of them holds the
fleet's relay lock (``state.outbox.Listener``) and is told of every commit that
sent: it publishes within milliseconds, and sweeps every ``outbox_relay_interval``
for what no notification announced (rows of a time no relay ran, a notification
lost with a connection, a handler's rows left by a crash). Elsewhere (SQLite) it
sweeps every interval; each round holds SQLite's write lock, so two processes
never relay the same rows.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

from ..settings import Settings
from ..state.outbox import RELAY_BATCH, Listener, Outbox
from ..support.failures import describe
from ..wire.publisher import Publisher

log = logging.getLogger("mdbcontainer.outbox")


class Relay:
    """One process's outbox relay; :meth:`run` until ``stop`` is set."""

    def __init__(self, settings: Settings, outbox: Outbox, stop: threading.Event) -> None:
        self.outbox = outbox
        self.stop = stop
        self.grace = settings.container.outbox_relay_grace
        self.interval = settings.container.outbox_relay_interval.total_seconds()
        self._failing = False

    def run(self) -> None:
        publisher = Publisher(self.outbox.broker, heartbeat=True)
        try:
            if self.outbox.store.dialect == "postgresql":
                self._listen(publisher)
            else:
                while not self.stop.wait(self.interval):
                    self.drain(publisher)
        finally:
            publisher.close()

    def _listen(self, publisher: Publisher) -> None:
        """Hold the fleet's relay (or try again every interval), publish, wait to be told."""
        while not self.stop.is_set():
            listener: Listener | None = None
            try:
                listener = Listener(self.outbox)
                while not self.stop.is_set():
                    if not listener.lead():
                        self.stop.wait(self.interval)  # another process relays: ready to take over
                        continue
                    self.drain(publisher)
                    listener.wait(self.interval)
            except Exception as exc:  # the database went away: a new connection, the lock again
                self._failed(exc)
                self.stop.wait(self.interval)
            finally:
                if listener is not None:
                    listener.close()

    def drain(self, publisher: Publisher) -> int:
        """Rounds until the outbox holds nothing to publish now; how many were sent."""
        total = 0
        while not self.stop.is_set():
            try:
                sent = self.outbox.relay(publisher, grace=self.grace)
            except Exception as exc:  # the broker or the database: the rows stay, a later round
                publisher.close()
                self._failed(exc)
                return total
            self._recovered()
            total += sent
            if sent < RELAY_BATCH:
                break
        return total

    def _failed(self, exc: BaseException) -> None:
        level = logging.DEBUG if self._failing else logging.WARNING
        self._failing = True
        log.log(level, "outbox relay will retry: %s", describe(exc))

    def _recovered(self) -> None:
        if self._failing:
            self._failing = False
            log.info("outbox relay publishing again")


def run_relay(settings: Settings) -> int:
    """``mdb relay``: create the tables, relay until SIGTERM or SIGINT; the exit code (0)."""
    outbox = Outbox.from_settings(settings)
    outbox.create_tables()
    stop = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        log.info("signal %s: relay stopping", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    log.info("outbox relay started for %s on %s", outbox.qualified_name, outbox.broker.masked_url)
    worker = threading.Thread(target=Relay(settings, outbox, stop).run, name="mdb-relay", daemon=True)
    worker.start()
    while not stop.wait(0.5):  # never an untimed wait: a signal's handler runs when this thread wakes
        if not worker.is_alive():
            return 1
    worker.join(10.0)
    outbox.store.dispose()
    log.info("outbox relay stopped")
    return 0
