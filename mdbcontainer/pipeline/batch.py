"""The batch path of the pipeline (README: Batches): gather, run, settle, or fall back.

A batched port's consumer runs steps 1-6 of the per-delivery pipeline on
each delivery as it arrives; the deliveries that pass them are gathered
until ``batch_size`` of them are there or the first has waited
``batch_linger``. Then the batch runs in one unit of work (``units/batch.py``)
and is settled together:

1. the outbox rows of the batch are published with their confirms awaited
   together (``Publisher.publish_many``), then the direct sends likewise;
2. second copies and already-claimed ids are acknowledged as duplicates;
3. the rest is acknowledged with one ``basic.ack`` carrying ``multiple``.

Nothing is acknowledged before the commit. A failure inside the batch (a
handler raised or marked rollback-only, the commit was refused) rolls the
whole batch back and counts nothing; then each message is run again alone,
through the per-message path of section 4, where only the message that fails
alone counts a failed delivery. A batch of one is that path already.

Overlap (container-managed batches on PostgreSQL): the unit of work of batch
k runs on the consumer's one batch worker thread while the consumer thread
goes on receiving and gathering batch k+1, so the consumer no longer sits
idle through the database round trips of each batch (BEGIN, claim, the
handler's statements, COMMIT). Only the consumer thread touches the broker
connection (py-amqp is not thread-safe): it settles batch k (acknowledges,
dispatches its outbox rows, or runs its messages alone after a failure)
once the worker is done, as soon as it notices between two reads, and at the
latest before batch k+1 starts. So one batch is in flight at a time, the
batches run and settle in delivery order, nothing is acknowledged before its
commit, and a crash between a commit and its acknowledgment leaves only
redeliveries that the dedup rows absorb. A graceful stop settles the batch
in flight before it hands back the one being gathered; a lost channel waits
for it and acknowledges nothing (the broker requeues, dedup absorbs).
"""

from __future__ import annotations

import contextvars
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass
from typing import Any, TypeVar

from ..errors import PublishError
from ..message import Message
from ..sending.replies import mark_consumer_thread
from ..support import clock
from ..support.crash import crash_point
from ..support.failures import describe
from ..support.outgoing import Outgoing
from ..support.tracing import NOTHING, Active
from ..units.batch import BatchItem, BatchOutcome, BatchRunner
from ..units.sequence import claims_first
from ..units.single import Outcome
from ..wire.connection import connection_errors
from ..wire.delivery import Delivery
from ..wire.publisher import Publish
from .acknowledge import Seen
from .attempt import Attempt
from .single import _GAVE_UP, ConsumerView, Pipeline, PortView

log = logging.getLogger("mdbcontainer.batching")

T = TypeVar("T")
# While a batch is in flight, the consumer blocks on its socket at most this long, so that
# the batch is settled soon after its commit even when nothing more arrives.
_POLL = 0.002


@dataclass
class _Gathered:
    delivery: Delivery
    message: Message
    argument: Any


@dataclass
class _InFlight:
    """A batch whose unit of work runs on the batch worker; the consumer settles it."""

    batch: list[_Gathered]
    future: Future[tuple[Any, float]]  # (the outcome or _GAVE_UP, the handler's seconds)
    context: contextvars.Context  # the batch span is current in it (worker and settling alike)
    span: Active
    started: float


class BatchPipeline(Pipeline):
    """The pipeline of a batched port (``batch_size > 1``, or a ``batch=True`` handler)."""

    # Deliveries older than a batch may still be unacknowledged (an ordered port's waiting keys):
    # then a batch is acknowledged message by message, not with one ``multiple`` ack.
    keeps_unacknowledged = False
    gathers = True

    def __init__(self, port: PortView, consumer: ConsumerView) -> None:
        super().__init__(port, consumer)
        self.size = self.settings.batch_size
        self.linger = self.settings.batch_linger.total_seconds()
        self.runner = BatchRunner(port.name, self.resources.units, self.invoker,
                                  transaction=self.settings.transaction,
                                  attribute=self.settings.transaction_attribute,
                                  once_only=self.once_only)
        self._gathered: list[_Gathered] = []
        self._first_at = 0.0
        # Overlap only where its safety is shown: container-managed, claims first (PostgreSQL:
        # a claim waits on a copy in flight elsewhere), acknowledge auto (batch_size > 1).
        store = self.resources.units.store
        self.overlap = (self.runner.kind == "container" and self.size > 1
                        and store is not None and claims_first(store))
        self._in_flight: _InFlight | None = None
        self._worker: ThreadPoolExecutor | None = None

    # -- gathering ---------------------------------------------------------

    def _deliver(self, attempt: Attempt, message: Message) -> None:
        """Steps 1-6 passed: the delivery joins the batch being gathered."""
        attempt.span.drop()  # the batch's span stands for it
        if not self._gathered:
            self._first_at = clock.monotonic()
        self._gathered.append(_Gathered(attempt.delivery, message, attempt.argument))
        if len(self._gathered) >= self.size:
            self.flush()

    def wait_limit(self, idle: float) -> float:
        """How long the consumer may block for the next delivery: until the linger is up
        (and briefly while a batch is in flight, to settle it soon after its commit)."""
        limit = idle
        if self._gathered:
            limit = max(0.0, min(idle, self._first_at + self.linger - clock.monotonic()))
        if self._in_flight is not None:
            limit = min(limit, _POLL)
        return limit

    def due(self) -> bool:
        """The batch in flight is done, or the first delivery of the batch being gathered has
        lingered long enough."""
        flight = self._in_flight
        if flight is not None and flight.future.done():
            return True
        return bool(self._gathered) and clock.monotonic() - self._first_at >= self.linger

    def tick(self) -> None:
        """Between deliveries: settle the batch whose unit of work is done; run the batch whose
        first delivery has lingered long enough."""
        flight = self._in_flight
        if flight is not None and flight.future.done():
            self.settle_in_flight()
        if self._gathered and clock.monotonic() - self._first_at >= self.linger:
            self.flush()

    def hand_back_gathered(self) -> None:
        """Graceful stop: the batch in flight is settled (its work may have committed); the batch
        being gathered has not started, and goes back uncounted."""
        sub = self.acks.sub
        if self._in_flight is not None and sub is not None:
            with sub.between_reads():  # nobody reads meanwhile: the heartbeats go on
                self.settle_in_flight()
        self.settle_in_flight()
        gathered, self._gathered = self._gathered, []
        for item in gathered:
            self.acks.hand_back(item.delivery, item.message.id)

    def release(self) -> Seen:
        """The channel is gone: the broker requeues the gathered batch, and the one in flight.

        The batch in flight is waited for (its commit, if it came, makes its
        redeliveries duplicates) and acknowledges nothing. Both batches' ids are
        returned: the consumer records their hand-back (counts.py).
        """
        flight, self._in_flight = self._in_flight, None
        seen = Seen([item.message.id for item in self._gathered])  # steps 1-6 passed: counted
        if flight is not None:
            with suppress(Exception):
                flight.future.result()
            flight.context.run(flight.span.end)
            seen.started += [item.message.id for item in flight.batch]
        self._gathered = []
        return seen

    def close(self) -> None:
        """The consumer ends: its batch worker (idle: release or the hand-back waited) goes too."""
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.shutdown(wait=True)
        super().close()

    # -- running -----------------------------------------------------------

    def flush(self) -> None:
        """Run the gathered batch (marked in flight for /healthz and the in-flight gauge).

        The batch in flight, if any, is settled first: batches run and settle in order.
        With overlap the gathered batch then starts on the batch worker, and the consumer
        goes back to receiving.
        """
        self.settle_in_flight()
        batch, self._gathered = self._gathered, []
        if not batch:
            return
        consumer = self.consumer
        consumer.delivering_since = started = time.monotonic()  # the batch's log lines count from here
        span: Active = NOTHING
        try:
            if self.port.stopping or consumer.handing_back:
                for item in batch:
                    self.acks.hand_back(item.delivery, item.message.id)
                return
            self.tally.sizes.observe(len(batch))
            if len(batch) == 1:  # alone already: the per-message path, exactly
                self._alone(batch[0], started)
            elif self.overlap:
                self._start(batch, started)
            else:
                span = self.tracing.batch([item.delivery for item in batch])
                outcome, seconds = self._work(self._items(batch))
                self._conclude_batch(batch, outcome, seconds, started)
        except connection_errors():
            raise  # the broker is gone: the consumer reconnects; the broker requeues
        except Exception as exc:
            self._container_error(batch, exc)
        finally:
            span.end()
            consumer.delivering_since = None
            consumer.alive_at = time.monotonic()

    def _container_error(self, batch: list[_Gathered], exc: Exception) -> None:
        log.exception("port %s: container error in a batch of %d", self.port.name, len(batch),
                      exc_info=exc)
        for item in batch:
            if not item.delivery.acknowledged:
                self.acks.failed(item.delivery)
        self.port.stop_for_failures(batch[0].message.id, exc, internal=True)

    def _items(self, batch: list[_Gathered]) -> list[BatchItem]:
        return [BatchItem(g.message, g.argument, self._mover(g.delivery)) for g in batch]

    def _mover(self, delivery: Delivery) -> Any:
        return lambda queue, reason: self.backout.copy(delivery, queue, reason, 0, None)

    def _work(self, items: list[BatchItem]) -> tuple[Any, float]:
        """The batch's unit of work, held through a database outage (on the batch worker with
        overlap); its outcome (``_GAVE_UP``: the port stopped meanwhile) and its seconds."""
        started = time.perf_counter()
        crash_point("before-handler")
        outcome = self._through_outages(lambda: self.runner.run(items, hold=self._hold),
                                        failed=lambda o: o.kind == "infrastructure")
        return outcome, time.perf_counter() - started

    # -- overlap -----------------------------------------------------------

    def _start(self, batch: list[_Gathered], started: float) -> None:
        """Start the batch's unit of work on the batch worker; the consumer settles it later."""
        context = contextvars.copy_context()  # the batch span current there, not in the consumer
        span = context.run(self.tracing.batch, [item.delivery for item in batch])
        if self._worker is None:
            self._worker = ThreadPoolExecutor(
                1, thread_name_prefix=f"{threading.current_thread().name}-batch",
                initializer=mark_consumer_thread, initargs=(self.port.name, self.settings))
        items = self._items(batch)
        future = self._worker.submit(context.run, self._work, items)
        self._in_flight = _InFlight(batch, future, context, span, started)

    def settle_in_flight(self) -> None:
        """Wait for the batch in flight (heartbeats go on meanwhile), then settle it here, on the
        consumer thread: acknowledge, publish, or run its messages alone."""
        flight, self._in_flight = self._in_flight, None
        if flight is None:
            return
        consumer = self.consumer
        marked = consumer.delivering_since is None
        if marked:  # waiting outside a delivery: still a batch in flight for /healthz
            consumer.delivering_since = flight.started
        try:
            done = _wait(flight.future)  # the worker has left the context once it is done
            flight.context.run(self._settle_flight, flight, done)
        finally:
            if marked:
                consumer.delivering_since = None
            consumer.alive_at = time.monotonic()

    def _settle_flight(self, flight: _InFlight, done: tuple[Any, float] | BaseException) -> None:
        try:
            if isinstance(done, BaseException):
                raise done
            self._conclude_batch(flight.batch, *done, flight.started)
        except connection_errors():
            raise
        except Exception as exc:
            self._container_error(flight.batch, exc)
        finally:
            flight.span.end()

    # -- concluding ----------------------------------------------------------

    def _conclude_batch(self, batch: list[_Gathered], outcome: Any, seconds: float,
                        started: float) -> None:
        """Settle the batch, or run its messages alone (``started``: the batch's start)."""
        if outcome is _GAVE_UP:
            for item in batch:
                self.acks.hand_back(item.delivery, item.message.id)
            return
        self.tally.handler.observe(seconds)
        if outcome.kind in ("failed", "conflict"):
            self._fall_back(batch, outcome, started)
        else:
            self._settle_batch(batch, outcome, started)

    def _hold(self, call: Callable[[], Outcome]) -> Outcome | None:
        """One message of a batch without a transaction, held through a database outage as alone."""
        outcome = self._through_outages(call, failed=lambda o: o.kind == "infrastructure")
        return None if outcome is _GAVE_UP else outcome

    def _fall_back(self, batch: list[_Gathered], outcome: BatchOutcome, started: float) -> None:
        """Roll back (done), count nothing, and run each message alone in its own unit of work."""
        self.tally.fallbacks += 1
        if outcome.kind == "failed":
            self.tracing.failed(outcome.error)
            log.warning("port %s: a batch of %d rolled back (%s); running each message alone",
                        self.port.name, len(batch), describe(outcome.error))
        else:  # a message of the batch was claimed already (bean-managed, or claimed last)
            log.info("port %s: a batch of %d holds a message applied before (%s); running each "
                     "message alone", self.port.name, len(batch), outcome.error)
        for index, item in enumerate(batch):
            if self.port.stopping:  # stopped for failures meanwhile: the rest go back uncounted
                for rest in batch[index:]:
                    self.acks.hand_back(rest.delivery, rest.message.id)
                return
            self._alone(item, started)
            crash_point("mid-acks")

    def _alone(self, item: _Gathered, started: float) -> None:
        """One gathered message through steps 7-8 alone, in its own span."""
        span = self.tracing.process(item.delivery)  # alone: the message's own span
        try:
            self.tracing.counted(item.message.redelivery_count)
            super()._deliver(Attempt(item.delivery, started, span, item.argument), item.message)
        finally:
            span.end()

    def _run(self, attempt: Attempt, message: Message) -> Outcome:
        """One message alone: a batch handler gets a list of one; a per-message one runs as ever."""
        if not self.invoker.spec.batch:
            return super()._run(attempt, message)
        delivery = attempt.delivery
        result = self.runner.run([BatchItem(message, attempt.argument, self._mover(delivery))],
                                 client_ack=self.acks.begin(delivery, message.id))
        if result.kind == "conflict" or (result.kind == "handled" and result.duplicates):
            return Outcome("duplicate_skipped")
        if result.kind != "handled":
            return Outcome(result.kind, result.error)
        return Outcome("handled", pending=result.pending, direct=[s for _, s in result.direct])

    # -- settling ----------------------------------------------------------

    def _settle_batch(self, batch: list[_Gathered], outcome: BatchOutcome, started: float) -> None:
        if outcome.pending:
            try:
                self.resources.outbox.dispatch(self.consumer.publisher, outcome.pending)
            except Exception as exc:  # the rows are committed: the relay sends them later
                log.warning("port %s: outbox publish deferred to the relay: %s",
                            self.port.name, describe(exc))
        failed = dict(outcome.failed)
        for index, error in self._publish_direct(outcome.direct).items():
            if index < 0:  # a batch handler's send: the batch is not done, run each alone
                self._fall_back(batch, BatchOutcome("failed", error), started)
                return
            failed.setdefault(index, Outcome("failed", error))
        for index in sorted(failed):  # transaction none: a failing message fails alone
            item = batch[index]
            self._failed(Attempt(item.delivery, started, argument=item.argument), item.message,
                         failed[index])
        for index in outcome.held_back:  # the port stopped during an outage: back uncounted
            self.acks.hand_back(batch[index].delivery, batch[index].message.id)
        duplicates = [batch[i] for i in outcome.duplicates]
        for item in duplicates:
            self.acks.discard(item.delivery)
        if duplicates:
            crash_point("mid-acks")
        handled = [batch[i] for i in outcome.handled if i not in failed]
        self.acks.settle_many([item.delivery for item in handled], one_by_one=self.keeps_unacknowledged)
        crash_point("after-ack")
        tally = self.tally
        tally.outcomes["duplicate_skipped"] += len(duplicates)
        tally.outcomes["handled"] += len(handled)
        for kind, items in (("duplicate_skipped", duplicates), ("handled", handled)):
            if items:  # the batch span's mdb.outcome, as counting them one by one set it
                self._outcomes.outcome(kind)
        for item in handled:
            tally.end_to_end(item.delivery.timestamp)
        if handled:
            self.port.after_success()
        if log.isEnabledFor(logging.DEBUG):
            log.debug("port %s: batch of %d: %d handled, %d duplicates, %d failed", self.port.name,
                      len(batch), len(handled), len(duplicates), len(failed))

    def _publish_direct(self, direct: list[tuple[int, Outgoing]]) -> dict[int, PublishError]:
        """Sends made without a transaction, confirmed together; the failures by message index."""
        if not direct:
            return {}
        publisher = self.consumer.publisher
        items: list[Publish] = []
        owners: list[int] = []
        failures: dict[int, PublishError] = {}
        for index, send in direct:
            try:
                if send.reply:
                    route = publisher.reply_route(send.destination)
                else:
                    route = publisher.route(send.destination)
            except PublishError as exc:
                failures.setdefault(index, exc)
                continue
            items.append(Publish(*route[:2], send.body, send.properties, route[2]))
            owners.append(index)
        for index, error in zip(owners, publisher.publish_many(items), strict=True):
            if error is not None:
                failures.setdefault(index, error)
        return failures


def _wait(future: Future[T]) -> T | BaseException:
    """The result of a future of the batch worker, or what it raised."""
    try:
        return future.result()
    except BaseException as exc:  # raised again on the consumer thread, in the batch's context
        return exc
