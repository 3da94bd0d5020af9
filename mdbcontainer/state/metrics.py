"""Prometheus metrics, one registry per container (never the process-global default).

A registry per container keeps tests and embedding applications that build
several containers in one process from colliding on metric names.

The hot path pays for a dictionary lookup and an increment: label children are
cached, and the gauges that describe a port's state (started, consecutive
failures, in-flight deliveries) are read from the port when Prometheus
scrapes, so a delivery never writes them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..message import from_epoch

OUTCOMES = ("handled", "failed", "backed_out", "duplicate_skipped", "expired", "invalid_body")
BATCH_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)
LATENCY_BUCKETS = (0.5, 1, 2, 5, 10, 30, 60, 300, 900, 3600, 21600, 86400)


class Metrics:
    """The container's metrics; cheap enough to update on every delivery."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.deliveries = Counter(
            "mdb_deliveries", "Deliveries by port and outcome.", ["port", "outcome"], registry=r
        )
        self.handler_seconds = Histogram(
            "mdb_handler_seconds", "Time in the unit of work (handler and commit).", ["port"],
            registry=r,
        )
        self.latency_seconds = Histogram(
            "mdb_end_to_end_seconds",
            "From the publish timestamp to the acknowledgment of a handled delivery. The AMQP "
            "timestamp has whole seconds, so a value is up to 1 s too high: read it in seconds, "
            "not milliseconds.",
            ["port"], registry=r, buckets=LATENCY_BUCKETS,
        )
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
        self.waiting = Gauge(
            "mdb_waiting", "Messages of the port's queue waiting out a redelivery delay on its wait "
            "queues (refreshed every few seconds).", ["port"], registry=r,
        )
        self.dedup_purged = Counter(
            "mdb_dedup_rows_purged", "Dedup rows deleted past retention.", registry=r
        )
        self.batch_sizes = Histogram(
            "mdb_batch_size", "Deliveries per batch unit of work (batched ports).", ["port"],
            registry=r, buckets=BATCH_BUCKETS,
        )
        self.batch_fallbacks = Counter(
            "mdb_batch_fallbacks",
            "Batches rolled back and then run again one message at a time.", ["port"], registry=r,
        )
        self._children: dict[tuple[str, str], Counter] = {}
        self._timers: dict[str, Histogram] = {}
        self._latencies: dict[str, Histogram] = {}

    def bind_port(self, port: str, *, started: Callable[[], bool], failures: Callable[[], int],
                  in_flight: Callable[[], int]) -> None:
        """Show every series of a port from the start (at 0), and read its state at scrape time.

        Prometheus' ``rate()`` and ``absent()`` need a series to exist before its
        first event, so a port that starts stopped still reports ``mdb_port_started 0``.
        """
        for outcome in OUTCOMES:
            self._children[(port, outcome)] = self.deliveries.labels(port=port, outcome=outcome)
        self._timers[port] = self.handler_seconds.labels(port=port)
        self.batch_sizes.labels(port=port)
        self.batch_fallbacks.labels(port=port)
        self._latencies[port] = self.latency_seconds.labels(port=port)
        self.port_started.labels(port=port).set_function(lambda: 1.0 if started() else 0.0)
        self.consecutive_failures.labels(port=port).set_function(lambda: float(failures()))
        self.in_flight.labels(port=port).set_function(lambda: float(in_flight()))

    def delivery(self, port: str, outcome: str) -> None:
        key = (port, outcome)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self.deliveries.labels(port=port, outcome=outcome)
        child.inc()

    def handler_time(self, port: str, seconds: float) -> None:
        timer = self._timers.get(port)
        if timer is None:
            timer = self._timers[port] = self.handler_seconds.labels(port=port)
        timer.observe(seconds)

    def batch(self, port: str, size: int) -> None:
        self.batch_sizes.labels(port=port).observe(size)

    def batch_fallback(self, port: str) -> None:
        self.batch_fallbacks.labels(port=port).inc()

    def end_to_end(self, port: str, timestamp: Any) -> None:
        """Observe now minus the message's AMQP timestamp; a message without one is skipped."""
        if isinstance(timestamp, int | float) and not isinstance(timestamp, bool):
            sent = float(timestamp)  # py-amqp's epoch seconds: no datetime on the hot path
        else:
            stamp = from_epoch(timestamp)
            if stamp is None:
                return
            sent = stamp.timestamp()
        latency = self._latencies.get(port)
        if latency is None:
            latency = self._latencies[port] = self.latency_seconds.labels(port=port)
        latency.observe(max(0.0, time.time() - sent))  # a producer's clock may run ahead

    def exposition(self) -> bytes:
        """The Prometheus text format of this registry."""
        return generate_latest(self.registry)
