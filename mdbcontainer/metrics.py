"""Prometheus metrics, one registry per container (never the process-global default).

A registry per container keeps tests and embedding applications that build
several containers in one process from colliding on metric names.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

OUTCOMES = ("handled", "failed", "backed_out", "duplicate_skipped", "expired", "invalid_body")


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
            "mdb_end_to_end_seconds", "From the publish timestamp to the acknowledgment.",
            ["port"], registry=r, buckets=(0.01, 0.05, 0.1, 0.5, 1, 5, 10, 60, 300, 3600),
        )
        self.port_started = Gauge(
            "mdb_port_started", "1 while the port consumes, 0 when stopped.", ["port"], registry=r
        )
        self.consecutive_failures = Gauge(
            "mdb_port_consecutive_failures", "Consecutive failed deliveries.", ["port"], registry=r
        )
        self.in_flight = Gauge(
            "mdb_deliveries_in_flight", "Deliveries inside a unit of work now.", ["port"], registry=r
        )
        self.outbox_backlog = Gauge(
            "mdb_outbox_backlog", "Outbox rows not yet published.", registry=r
        )
        self.dedup_purged = Counter(
            "mdb_dedup_rows_purged", "Dedup rows deleted past retention.", registry=r
        )
        self._children: dict[tuple[str, str], Counter] = {}
        self._timers: dict[str, Histogram] = {}

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

    def port_state(self, port: str, started: bool) -> None:
        self.port_started.labels(port=port).set(1 if started else 0)
