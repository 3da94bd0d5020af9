"""What a container's ports share: broker, database tables, control, metrics, outage reports.

One :class:`SharedResources` per container process. The pipeline and the
ports reach the tables through it; outages are logged here once for the
whole process, not once per consumer or per message.
"""

from __future__ import annotations

import logging
import threading
import time

from ..settings import Settings
from ..state.control import Control
from ..state.counts import DeliveryCounter
from ..state.dedup import Dedup
from ..state.holds import Holds
from ..state.metrics import Metrics
from ..state.outbox import Outbox
from ..state.store import Store
from ..support.failures import describe
from ..support.logs import fields
from ..units.single import TransactionResources
from ..wire.connection import Broker, Capabilities

log = logging.getLogger("mdbcontainer.resources")

# Consumers busy in a handler notice a lost connection late, after others have
# reconnected: a loss this soon after a restore is the same outage (an echo),
# logged at DEBUG unless it lasts longer than this.
OUTAGE_ECHO = 2.0


class SharedResources:
    """What a container's ports share: broker, database tables, control, metrics."""

    def __init__(self, settings: Settings, store: Store, broker: Broker) -> None:
        self.settings = settings
        self.store = store
        self.broker = broker
        self.capabilities: Capabilities = broker.capabilities
        self.counter = DeliveryCounter(store, settings.container.control_interval)
        self.dedup = Dedup(store)
        self.holds = Holds(store)  # ordered ports' held keys
        self.outbox = Outbox(store, broker)
        self.control = Control(store)
        self.metrics = Metrics()
        self.units = TransactionResources(store, self.dedup, self.outbox)
        self.shutting_down = False
        # Set by Container.kill (mdbcontainer.testing's crash): the consumers end as a killed
        # process's would, handing nothing back and leaving their leases open.
        self.killed = False
        self._outages: dict[str, tuple[float, str]] = {}  # kind: (since, what failed)
        self._restored: dict[str, float] = {}  # kind: when its last outage ended
        self._echoes: set[str] = set()
        self._lock = threading.Lock()

    def outage(self, kind: str, error: BaseException | None) -> None:
        """Log an outage once, not once per message or per consumer."""
        with self._lock:
            level = self._outage_level(kind, time.monotonic(), error)
        if level is None:
            return
        where = self.broker.masked_url if kind == "broker" else "the database"
        log.log(level, "%s unavailable (%s): %s; retrying with backoff, counting nothing against "
                "messages", kind, where, describe(error), extra=fields(outage=kind, outcome="outage"))

    def _outage_level(self, kind: str, now: float, error: BaseException | None) -> int | None:
        """How to log this report of an outage: None when it is already logged."""
        current = self._outages.get(kind)
        if current is None:
            self._outages[kind] = (now, describe(error))
            restored = self._restored.get(kind)  # never restored: a first outage, never an echo
            if restored is not None and now - restored < OUTAGE_ECHO:
                self._echoes.add(kind)
                return logging.DEBUG
            return logging.ERROR
        if kind in self._echoes and now - current[0] >= OUTAGE_ECHO:  # an echo that lasts
            self._echoes.discard(kind)
            return logging.ERROR
        return None

    def recovered(self, kind: str) -> None:
        if kind not in self._outages:
            return
        with self._lock:
            if kind not in self._outages:
                return
            since, _ = self._outages.pop(kind)
            self._restored[kind] = time.monotonic()
            level = logging.DEBUG if kind in self._echoes else logging.INFO
            self._echoes.discard(kind)
        duration = time.monotonic() - since
        log.log(level, "%s connection restored after %.1fs", kind, duration,
                extra=fields(outage=kind, outcome="restored", duration=round(duration, 3)))

    @property
    def outages(self) -> set[str]:
        return set(self._outages)

    def outage_report(self) -> dict[str, tuple[float, str]]:
        """Each current outage: seconds since it began, and what failed (for /readyz)."""
        now = time.monotonic()
        with self._lock:
            return {kind: (now - since, error) for kind, (since, error) in self._outages.items()}
