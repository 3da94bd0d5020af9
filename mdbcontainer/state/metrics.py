"""Prometheus metrics, one registry per container (never the process-global default).

A registry per container keeps tests and embedding applications that build
several containers in one process from colliding on metric names.

A delivery writes no Prometheus object and takes no lock: each consumer
counts its outcomes and timings in its own :class:`Tally` (plain integers and
bucket counts, written by the consumer's thread only), and the registry's
collector adds the tallies of every port when Prometheus scrapes, as it reads
the gauges that describe a port's state (started, consecutive failures,
in-flight deliveries) from the port itself.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from ..message import from_epoch

OUTCOMES = ("handled", "failed", "backed_out", "duplicate_skipped", "expired", "invalid_body")
HANDLER_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
BATCH_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)
LATENCY_BUCKETS = (0.5, 1, 2, 5, 10, 30, 60, 300, 900, 3600, 21600, 86400)


class Buckets:
    """A histogram in plain numbers: a count per bucket (the last one is ``+Inf``) and the sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # the first bound >= value: Prometheus' le
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)


class Tally:
    """One consumer's figures. Only the consumer's own thread writes them, so no lock: readers
    (``/metrics``, ``mdb ports``) add a port's tallies and may see a delivery late, never twice."""

    __slots__ = ("fallbacks", "handler", "latency", "outcomes", "sizes")

    def __init__(self) -> None:
        self.outcomes = dict.fromkeys(OUTCOMES, 0)
        self.handler = Buckets(HANDLER_BUCKETS)  # seconds in the unit of work
        self.latency = Buckets(LATENCY_BUCKETS)  # publish to acknowledgment, handled only
        self.sizes = Buckets(BATCH_BUCKETS)  # deliveries per batch (batched ports)
        self.fallbacks = 0  # batches rolled back and run again one by one

    def count(self, outcome: str) -> None:
        self.outcomes[outcome] += 1

    def handled(self, seconds: float, timestamp: Any) -> None:
        """A handled delivery: its outcome, its time in the unit of work and its end-to-end latency,
        in one call (the ``none`` port's first deliveries, ``pipeline/single.py``)."""
        self.outcomes["handled"] += 1
        handler = self.handler
        handler.counts[bisect_left(handler.bounds, seconds)] += 1
        handler.sum += seconds
        if type(timestamp) is int:  # py-amqp's epoch seconds
            latency = self.latency
            value = time.time() - timestamp
            value = value if value > 0.0 else 0.0  # a producer's clock may run ahead
            latency.counts[bisect_left(latency.bounds, value)] += 1
            latency.sum += value
        elif timestamp is not None:
            self.end_to_end(timestamp)

    def end_to_end(self, timestamp: Any) -> None:
        """Observe now minus the message's AMQP timestamp; a message without one is skipped."""
        if timestamp is None:
            return
        if isinstance(timestamp, int | float) and not isinstance(timestamp, bool):
            sent = float(timestamp)  # py-amqp's epoch seconds: no datetime on the hot path
        else:
            stamp = from_epoch(timestamp)
            if stamp is None:
                return
            sent = stamp.timestamp()
        self.latency.observe(max(0.0, time.time() - sent))  # a producer's clock may run ahead


def _histogram(family: HistogramMetricFamily, port: str, parts: list[Buckets]) -> None:
    bounds = parts[0].bounds if parts else ()
    running, buckets = 0, []
    for index, le in enumerate([*map(floatToGoString, bounds), "+Inf"]):
        running += sum(b.counts[index] for b in parts)
        buckets.append((le, running))
    family.add_metric([port], buckets, sum_value=sum(b.sum for b in parts))


class _TallyCollector:
    """The per-delivery series, added up from the ports' tallies when Prometheus scrapes."""

    def __init__(self) -> None:
        self.ports: dict[str, Callable[[], list[Tally]]] = {}

    def describe(self) -> Iterator[Metric]:
        return self._families()

    def collect(self) -> Iterator[Metric]:
        return self._families({port: read() for port, read in self.ports.items()})

    def _families(self, tallies: dict[str, list[Tally]] | None = None) -> Iterator[Metric]:
        deliveries = CounterMetricFamily("mdb_deliveries", "Deliveries by port and outcome.",
                                         labels=["port", "outcome"])
        handler = HistogramMetricFamily("mdb_handler_seconds",
                                        "Time in the unit of work (handler and commit).", labels=["port"])
        latency = HistogramMetricFamily(
            "mdb_end_to_end_seconds",
            "From the publish timestamp to the acknowledgment of a handled delivery. The AMQP "
            "timestamp has whole seconds, so a value is up to 1 s too high: read it in seconds, "
            "not milliseconds.", labels=["port"])
        sizes = HistogramMetricFamily("mdb_batch_size",
                                      "Deliveries per batch unit of work (batched ports).", labels=["port"])
        fallbacks = CounterMetricFamily("mdb_batch_fallbacks",
                                        "Batches rolled back and then run again one message at a time.",
                                        labels=["port"])
        for port, parts in (tallies or {}).items():
            for outcome in OUTCOMES:
                deliveries.add_metric([port, outcome], sum(t.outcomes[outcome] for t in parts))
            _histogram(handler, port, [t.handler for t in parts] or [Buckets(HANDLER_BUCKETS)])
            _histogram(latency, port, [t.latency for t in parts] or [Buckets(LATENCY_BUCKETS)])
            _histogram(sizes, port, [t.sizes for t in parts] or [Buckets(BATCH_BUCKETS)])
            fallbacks.add_metric([port], sum(t.fallbacks for t in parts))
        yield from (deliveries, handler, latency, sizes, fallbacks)


class Metrics:
    """The container's metrics; a delivery only writes its consumer's :class:`Tally`."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self._tallies = _TallyCollector()
        r.register(self._tallies)
        self.port_started = Gauge(
            "mdb_port_started", "1 while the port consumes, 0 when stopped.", ["port"], registry=r
        )
        self.consecutive_failures = Gauge(
            "mdb_port_consecutive_failures",
            "Consecutive failed deliveries (the port stops when it exceeds max_retries).",
            ["port"], registry=r,
        )
        self.in_flight = Gauge(
            "mdb_deliveries_in_flight", "Deliveries being processed now.", ["port"], registry=r
        )
        self.outbox_backlog = Gauge(
            "mdb_outbox_backlog", "Outbox rows not yet published (refreshed every few seconds).",
            registry=r,
        )
        self.outbox_waiting = Gauge(
            "mdb_outbox_waiting", "Sends waiting in the outbox for the relay or their consumer "
            "(refreshed every few seconds).", registry=r,
        )
        self.outbox_oldest = Gauge(
            "mdb_outbox_oldest_seconds", "Age of the oldest send waiting in the outbox, 0 when none "
            "(refreshed every few seconds).", registry=r,
        )
        self.waiting = Gauge(
            "mdb_waiting", "Messages of the port's queue waiting out a redelivery delay on its wait "
            "queues (refreshed every few seconds).", ["port"], registry=r,
        )
        self.dedup_purged = Counter(
            "mdb_dedup_rows_purged", "Dedup rows deleted past retention.", registry=r
        )

    def bind_port(self, port: str, *, started: Callable[[], bool], failures: Callable[[], int],
                  in_flight: Callable[[], int], tallies: Callable[[], list[Tally]]) -> None:
        """Show every series of a port from the start (at 0), and read it all at scrape time.

        Prometheus' ``rate()`` and ``absent()`` need a series to exist before its
        first event, so a port that starts stopped still reports ``mdb_port_started 0``.
        """
        self._tallies.ports[port] = tallies
        self.port_started.labels(port=port).set_function(lambda: 1.0 if started() else 0.0)
        self.consecutive_failures.labels(port=port).set_function(lambda: float(failures()))
        self.in_flight.labels(port=port).set_function(lambda: float(in_flight()))

    def exposition(self) -> bytes:
        """The Prometheus text format of this registry."""
        return generate_latest(self.registry)
