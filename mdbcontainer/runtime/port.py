"""ListenerPort: a port's consumers, its state, and Maximum retries.

A port runs ``concurrency`` consumers, each a thread with its own broker
connection and channel, blocking in ``drain_events`` (kombu's async loop can
hold a queued ack for seconds; a blocking loop per thread does not).

Maximum retries counts consecutive failed deliveries across the port's
consumers. Success resets the count, and so does a backout. One failure more
than ``max_retries`` stops the port: the failing message is requeued first,
then the port's state turns ``stopped`` for the whole fleet (see control.py)
and every consumer hands back what it holds.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import tenacity

from ..errors import SubscriptionInUse
from ..handlers.registry import HandlerSpec, Running
from ..pipeline.acknowledge import acknowledger_for, check_mode
from ..pipeline.async_single import AsyncPipeline
from ..pipeline.kinds import pipeline_for
from ..pipeline.resources import SharedResources
from ..pipeline.single import Decision, Pipeline
from ..sending.replies import mark_consumer_thread
from ..settings import PortSettings, QueueSettings
from ..state.counts import DeliveryCounter
from ..state.metrics import Tally
from ..support.crash import Killed
from ..support.failures import describe
from ..support.logs import fields
from ..support.outgoing import Outgoing
from ..support.retry import DEFAULT as RETRY
from ..support.retry import RetryPolicy
from ..wire.connection import connection_errors
from ..wire.publisher import Publisher
from ..wire.subscription import Subscription

log = logging.getLogger("mdbcontainer.port")


@dataclass
class PortStats:
    """A port's figures as ``mdb ports`` shows them: its consumers' tallies added up when read."""

    delivered: int = 0
    handled: int = 0
    failed: int = 0
    backed_out: int = 0
    expired: int = 0
    duplicate_skipped: int = 0
    invalid_body: int = 0
    consecutive_failures: int = 0
    batches: int = 0  # batch units of work run (batched ports)
    batched: int = 0  # deliveries in them
    fallbacks: int = 0  # batches rolled back and run again one by one


@dataclass(frozen=True)
class Stuck:
    """A consumer whose handler call has run past the port's ``handler_timeout``."""

    port: str
    consumer: int
    message_ids: tuple[str, ...]
    seconds: float
    timeout: float

    def describe(self) -> str:
        ids = ", ".join(self.message_ids) or "-"
        what = f"message {ids}" if len(self.message_ids) <= 1 else f"batch of messages {ids}"
        return (f"port {self.port} consumer {self.consumer}: handler stuck for {self.seconds:.0f}s "
                f"on {what} (handler_timeout {self.timeout:g}s)")

    def row(self) -> dict[str, Any]:
        return {"consumer": self.consumer, "message_ids": list(self.message_ids),
                "seconds": round(self.seconds, 1)}


@dataclass
class ListenerPort:
    """One listener port inside one container process."""

    name: str
    settings: PortSettings
    spec: HandlerSpec
    resources: SharedResources
    queue_settings: QueueSettings
    backout_queue: str
    state: str = "stopped"
    reason: str = ""
    since: datetime = field(default_factory=lambda: datetime.now(UTC))
    consumers: list[PortConsumer] = field(default_factory=list)
    policy: RetryPolicy = RETRY
    # How long a consumer blocks in one read of its connection: also how soon it sees a stop.
    # mdbcontainer.testing shortens it, so that a test's container stops in milliseconds.
    idle_read: float = 0.5
    # Called after every state change, so the container writes its heartbeat at once and
    # mdb ports shows the new state without waiting for control_interval. Must not block.
    on_state_change: Callable[[], None] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()  # consecutive failures: counted across the consumers
        self.consecutive_failures = 0
        # One tally per consumer index, kept across restarts of the port: a consumer's thread
        # is its only writer (a restarted port's consumer starts after the old one ended).
        self.tallies: list[Tally] = []
        # Stopping and the state it shows change together: a consumer that connects just as
        # the control thread stops the port must not turn it back to ``started``.
        self._state_lock = threading.Lock()
        self.stop_event = threading.Event()
        # A non-durable subscription without a name is this port's own: unique per process.
        self._subscription_name = f"{self.name}.{uuid.uuid4().hex[:12]}"
        # The queue read, and the key of its counts and leases (counts.py): a non-durable
        # subscription's own name, never one key that every such port would share.
        self.queue = self.settings.queue_name or self._subscription_name
        self.ever_consumed = False
        # Refuse at start a mode the transport cannot provide (one line naming the key).
        check_mode(self.resources.settings.source, self.name, self.settings.acknowledge,
                   self.resources.capabilities)

    # -- lifecycle ----------------------------------------------------------

    def start(self) -> None:
        """Start the consumers: ``starting``, then ``started`` once all of them consume.

        ``starting`` is a state of its own, so that ``mdb ports`` (which sees a port
        from the container's first heartbeat) never shows a port on its way up as
        ``stopped``.
        """
        if self.consumers:
            return
        self.stop_event.clear()
        with self._lock:
            self.consecutive_failures = 0
        with self._state_lock:
            self._set_state("starting", "")
        # An async handler's port: one consumer, its event loop running ``concurrency`` tasks.
        # An ordered port: one consumer too, whose loop keeps the keys' order (pipeline/ordered.py);
        # ordered batches, one consumer taking them in delivery order.
        one = (self.spec.is_async or self.settings.order_by is not None) and not self.batched
        one = one or (self.settings.order_by is not None and self.batched)
        consumers = 1 if one else self.settings.concurrency
        self.consumers = [PortConsumer(self, i) for i in range(consumers)]
        for consumer in self.consumers:
            consumer.thread.start()

    def stop(self, reason: str, *, wait: float | None = None, logged: bool = False) -> None:
        """Stop consuming; in-flight deliveries finish, prefetched ones are handed back.

        ``logged``: the caller logs the stop itself (at shutdown, once the deliveries finished).
        """
        with self._state_lock:
            self.stop_event.set()
            self._set_state("stopped", reason, logged=logged)
        if wait is not None:
            self.join(wait)

    def join(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        for consumer in list(self.consumers):
            if consumer.thread is not threading.current_thread():
                consumer.thread.join(max(0.0, deadline - time.monotonic()))
        alive = any(c.thread.is_alive() for c in self.consumers)
        if not alive:
            self.consumers = []
        return not alive

    @property
    def stopping(self) -> bool:
        return self.stop_event.is_set()

    def tally_for(self, index: int) -> Tally:
        """The tally consumer ``index`` writes (the same one after a restart of the port)."""
        while len(self.tallies) <= index:
            self.tallies.append(Tally())
        return self.tallies[index]

    @property
    def stats(self) -> PortStats:
        """The figures of ``mdb ports``, added up from the consumers' tallies now."""
        tallies = list(self.tallies)
        counted = {o: sum(t.outcomes[o] for t in tallies) for o in tallies[0].outcomes} if tallies else {}
        return PortStats(
            delivered=sum(n for o, n in counted.items() if o != "expired"),
            consecutive_failures=self.consecutive_failures,
            batches=sum(t.sizes.count for t in tallies),
            batched=int(sum(t.sizes.sum for t in tallies)),
            fallbacks=sum(t.fallbacks for t in tallies),
            **counted,
        )

    def held_keys(self) -> list[dict[str, Any]]:
        """An ordered port's held keys (on_backout = "hold"), as its consumer's pipeline holds them."""
        for consumer in list(self.consumers):
            held = getattr(consumer.pipeline, "held_keys", None)
            if held is not None:
                for _ in range(3):  # read from another thread: a key may come or go meanwhile
                    try:
                        return list(held())
                    except RuntimeError:
                        continue
        return []

    @property
    def batched(self) -> bool:
        return self.settings.batch_size > 1 or self.spec.batch

    @property
    def counter(self) -> DeliveryCounter:
        return self.resources.counter

    def declare(self, channel: Any) -> str | list[str]:
        """Declare the port's queue (or subscription) and its backout queue; return the queue name
        (the partitions' names, for a partitioned destination)."""
        broker = self.resources.broker
        broker.declare_queue(channel, self.backout_queue)
        if self.settings.topic is not None:
            name = self.settings.subscription_queue or self._subscription_name
            return broker.declare_subscription(channel, self.settings.topic, name, self.settings.durable)
        broker.declare_queue(channel, self.queue)
        part = broker.partitions.get(self.queue) if self.settings.partitions else None
        return part.queues if part is not None else self.queue

    def consumer_changed(self) -> None:
        """Called by consumers as they connect or drop; ``started`` only when all consume."""
        with self._state_lock:
            if self.stopping:
                return
            up = sum(1 for c in self.consumers if c.consuming)
            if up == len(self.consumers) and up:
                self.ever_consumed = True
                self._set_state("started", "")
            elif self.state == "started":
                self._set_state("stopped", f"{len(self.consumers) - up} consumer(s) reconnecting")

    def _set_state(self, state: str, reason: str, *, logged: bool = False) -> None:
        if (state, reason) != (self.state, self.reason):
            self.state, self.reason, self.since = state, reason, datetime.now(UTC)
            if not logged:  # one line per state change: the caller may have logged it richer
                log.info("port %s %s%s", self.name, state, f": {reason}" if reason else "",
                         extra=fields(port=self.name, state=state, reason=reason))
            if self.on_state_change is not None:
                self.on_state_change()

    def stuck(self, now: float | None = None) -> list[Stuck]:
        """The consumers whose handler call has outlived ``handler_timeout`` (none when it is off)."""
        return [stuck for stuck, _ in self._stuck_calls(now)]

    def _stuck_calls(self, now: float | None = None) -> list[tuple[Stuck, Running]]:
        timeout = self.settings.handler_timeout.total_seconds()
        if timeout <= 0:
            return []
        now = time.monotonic() if now is None else now
        found = []
        for consumer in list(self.consumers):
            running = consumer.running
            seconds = running.seconds(now)
            if seconds is not None and seconds > timeout:
                found.append((Stuck(self.name, consumer.index, running.message_ids, seconds, timeout),
                              running))
        return found

    def warn_stuck(self) -> None:
        """One WARNING per stuck handler call, the first time it is seen past the timeout."""
        for stuck, running in self._stuck_calls():
            if running.warned:
                continue
            running.warned = True
            log.warning("%s: it holds its prefetched messages; /healthz fails until it returns",
                        stuck.describe(), extra=fields(port=self.name, outcome="stuck",
                                                       message_id=",".join(stuck.message_ids),
                                                       duration=round(stuck.seconds, 3)))

    # -- Maximum retries ---------------------------------------------------

    def after_success(self) -> None:
        if self.consecutive_failures:  # the lock only when there is something to reset
            with self._lock:
                self.consecutive_failures = 0

    def after_backout(self) -> None:
        with self._lock:
            self.consecutive_failures = 0

    def after_failure(self) -> Decision:
        with self._lock:
            self.consecutive_failures += 1
            over = self.consecutive_failures > self.settings.max_retries
        return "stop" if over else "continue"

    def stop_for_failures(self, message_id: str, error: BaseException, *, internal: bool = False,
                          reason: str | None = None) -> None:
        """Maximum retries exceeded (or the container failed): stop this port fleet-wide."""
        reason = reason or self._stop_reason(message_id, error, internal)
        log.error("port %s stopped: %s", self.name, reason,
                  extra=fields(port=self.name, message_id=message_id, outcome="port_stopped",
                               state="stopped", reason=reason))
        with self._state_lock:
            self.stop_event.set()
            self._set_state("stopped", reason, logged=True)
        self.resources.control.set_port(self.name, "stopped", reason)

    def _stop_reason(self, message_id: str, error: BaseException, internal: bool) -> str:
        if internal:
            return f"container error on message {message_id}: {describe(error)}"
        return (
            f"maximum retries ({self.settings.max_retries}) exceeded: "
            f"{self.consecutive_failures} consecutive failed deliveries, last message "
            f"{message_id}: {describe(error)}"
        )


class PortConsumer:
    """One consumer thread of a port: connect, declare, consume, and reconnect with backoff."""

    def __init__(self, port: ListenerPort, index: int) -> None:
        self.port = port
        self.index = index
        self.consuming = False
        self.handing_back = False
        self._publisher: Publisher | None = None
        self._lease: str | None = None  # this connection's row in the lease table (counts.py)
        self.acks = acknowledger_for(port)
        self.tally = port.tally_for(index)  # this thread's counts, read by /metrics and mdb ports
        self.thread = threading.Thread(
            target=self._run, name=f"mdb-{port.name}-{index}", daemon=True
        )
        self.alive_at = time.monotonic()
        # Set by the pipeline while a delivery runs: /healthz and the in-flight gauge read it.
        self.delivering_since: float | None = None
        self.running = Running()  # the handler call in progress (handler_timeout)
        self.pipeline: Pipeline | None = None  # while the thread runs

    @property
    def publisher(self) -> Publisher:
        if self._publisher is None:
            self._publisher = Publisher(self.port.resources.broker, heartbeat=True)
        return self._publisher

    def publish(self, message: Outgoing) -> None:
        """Publish with confirm (and mandatory for a queue); a failure leaves the original unacked."""
        publisher = self.publisher
        if message.reply:
            exchange, routing_key, mandatory = publisher.reply_route(message.destination)
        else:
            exchange, routing_key, mandatory = publisher.route(message.destination)
        # Transacted: on the consumer's own channel, to commit with the acknowledgment.
        target: Any = self.acks if self.acks.transacted else publisher
        target.publish(exchange=exchange, routing_key=routing_key, body=message.body,
                       properties=message.properties, mandatory=mandatory)

    def _should_run(self) -> bool:
        return not self.port.stopping and not self.port.resources.shutting_down

    def _run(self) -> None:
        pipeline = self.pipeline = pipeline_for(self.port, self)
        pipeline.invoker.running = self.running
        mark_consumer_thread(self.port.name, self.port.settings)
        try:
            while self._should_run():
                sub = self._open(pipeline)
                if sub is None:
                    break
                killed = False
                try:
                    self._drain(sub, pipeline)
                except connection_errors() as exc:
                    self.port.resources.outage("broker", exc)
                except Killed:
                    killed = True
                    self._lease = None  # a killed process ends no lease: its deliveries count
                    raise
                finally:
                    self._set_consuming(False)
                    seen = pipeline.release()
                    if not killed:  # a killed process records no hand-back: its deliveries count
                        self.acks.release(seen)
                    sub.close()
                    self._end_lease()  # before consuming again: none of its deliveries counts
        except Killed:
            log.debug("port %s consumer %d killed at a crash point", self.port.name, self.index)
        except Exception as exc:  # a channel error (a queue deleted, a declare refused...)
            if self._should_run():
                log.exception("port %s consumer %d ended: %s", self.port.name, self.index, exc)
                self.port.stop_for_failures("-", exc, reason=f"consumer error: {describe(exc)}")
        finally:
            pipeline.close()
            if self._publisher is not None:
                self._publisher.close()

    def _open(self, pipeline: Pipeline) -> Subscription | None:
        """Connect and start consuming, retrying with backoff until it works or the port stops."""
        retrying = self.port.policy.until_stopped(
            self.port.stop_event, retry=tenacity.retry_if_exception_type(connection_errors()),
            before_sleep=self._before_retry,
        )
        try:
            return retrying(self._subscribe, pipeline)
        except connection_errors():
            return None
        except SubscriptionInUse as exc:  # not a fault to retry: JMS refuses a second subscriber
            reason = f"{exc} (then mdb port start {self.port.name})"
            log.error("port %s stopped: %s", self.port.name, reason)
            self.port.stop_event.set()
            self.port._set_state("stopped", reason, logged=True)
            return None

    def _before_retry(self, state: tenacity.RetryCallState) -> None:
        error = state.outcome.exception() if state.outcome else None
        self.port.resources.outage("broker", error)
        wait = state.upcoming_sleep
        level = logging.WARNING if not self.port.ever_consumed else logging.DEBUG
        log.log(level, "port %s consumer %d: broker connection attempt %d failed; retrying in %.1fs",
                self.port.name, self.index, state.attempt_number, wait)

    def _subscribe(self, pipeline: Pipeline) -> Subscription | None:
        if not self._should_run():
            return None
        self._begin_lease()
        sub = Subscription(self.port.resources.broker, self.port.queue,
                           self.port.settings.prefetch, self.acks.deliver(pipeline),
                           self.port.declare, exclusive=self.port.settings.durable,
                           transacted=self.acks.transacted, before_wait=self.acks.flush_owed)
        try:
            sub.open()
        except BaseException:
            sub.close()
            self._end_lease()
            raise
        self.acks.attach(sub)
        return sub

    def _begin_lease(self) -> None:
        """Write this connection's lease before it consumes: the evidence, should the process die."""
        try:
            self._lease = self.port.counter.begin_lease(self.port.queue, self.port.resources.control.id)
        except Exception as exc:  # the database is away: a death now goes uncounted, nothing else
            log.warning("port %s consumer %d: could not write its lease: %s", self.port.name,
                        self.index, describe(exc))

    def _end_lease(self) -> None:
        """The connection ended and the process lives: none of its deliveries counts as failed."""
        lease, self._lease = self._lease, None
        if lease is None:
            return
        try:
            self.port.counter.end_lease(lease)
        except Exception as exc:  # left open, its holder alive: still not the evidence of a death
            log.warning("port %s consumer %d: could not end its lease: %s", self.port.name,
                        self.index, describe(exc))

    def _drain(self, sub: Subscription, pipeline: Pipeline) -> None:
        self.port.resources.recovered("broker")
        self._set_consuming(True)
        if isinstance(pipeline, AsyncPipeline):  # its event loop reads the connection (and stops)
            pipeline.drive(sub, self._should_run)
        stop, resources = self.port.stop_event, self.port.resources  # _should_run, once a delivery
        # A pipeline that gathers nothing and an acknowledgment mode with nothing to do between
        # drains (each says so) are not asked, once a delivery, whether they have something to do.
        gathers, ticks = pipeline.gathers, self.acks.ticks
        idle = self.port.idle_read
        while not stop.is_set() and not resources.shutting_down:
            self.alive_at = time.monotonic()
            if not gathers:
                sub.drain(idle)
            else:
                sub.drain(pipeline.wait_limit(idle))
                if pipeline.due():  # a lingered batch may run longer than two heartbeats
                    with sub.between_reads():
                        pipeline.tick()
            if ticks:
                self.acks.tick()
        if resources.killed:  # the process "died": nothing is handed back
            raise Killed
        pipeline.hand_back_gathered()
        self._hand_back_all(sub)

    def _set_consuming(self, value: bool) -> None:
        if self.consuming != value:
            self.consuming = value
            self.port.consumer_changed()

    def _hand_back_all(self, sub: Subscription) -> None:
        """Graceful stop: cancel, so deliveries sent before the cancel reach the pipeline's hand-back."""
        self.handing_back = True
        sub.cancel()
        self.acks.close()
        self.handing_back = False
