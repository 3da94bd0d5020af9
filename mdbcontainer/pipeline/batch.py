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
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

from ..errors import PublishError
from ..message import Message
from ..support.crash import crash_point
from ..support.failures import describe
from ..support.outgoing import Outgoing
from ..units.async_batch import AsyncBatchRunner
from ..units.async_single import AsyncUnitOfWork, async_resources, async_unit_class, dispose
from ..units.batch import BatchItem, BatchOutcome, BatchRunner
from ..units.context import MessageContext
from ..units.single import Outcome
from ..wire.connection import connection_errors
from ..wire.delivery import Delivery
from ..wire.publisher import Publish
from .async_single import AsyncPipeline
from .single import _GAVE_UP, ConsumerView, Pipeline, PortView

log = logging.getLogger("mdbcontainer.batching")


@dataclass
class _Gathered:
    delivery: Delivery
    message: Message
    argument: Any


class BatchPipeline(Pipeline):
    """The pipeline of a batched port (``batch_size > 1``, or a ``batch=True`` handler)."""

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

    # -- gathering ---------------------------------------------------------

    def _deliver(self, delivery: Delivery, message: Message) -> None:
        """Steps 1-6 passed: the delivery joins the batch being gathered."""
        self._span.drop()  # the batch's span stands for it
        if not self._gathered:
            self._first_at = time.monotonic()
        self._gathered.append(_Gathered(delivery, message, self._argument))
        if len(self._gathered) >= self.size:
            self.flush()

    def wait_limit(self, idle: float) -> float:
        """How long the consumer may block for the next delivery: until the linger is up."""
        if not self._gathered:
            return idle
        return max(0.0, min(idle, self._first_at + self.linger - time.monotonic()))

    def due(self) -> bool:
        """The first delivery of the batch being gathered has lingered long enough."""
        return bool(self._gathered) and time.monotonic() - self._first_at >= self.linger

    def tick(self) -> None:
        """Between deliveries: run the batch whose first delivery has lingered long enough."""
        if self.due():
            self.flush()

    def hand_back_gathered(self) -> None:
        """Graceful stop: the batch being gathered has not started; it goes back uncounted."""
        gathered, self._gathered = self._gathered, []
        for item in gathered:
            self.acks.hand_back(item.delivery, item.message.id)

    def release(self) -> None:
        """The channel is gone: the broker requeues the gathered batch.

        Nothing is written: the connection's lease, ended by the consumer, says
        that none of its deliveries counts (counts.py).
        """
        self._gathered = []

    # -- running -----------------------------------------------------------

    def flush(self) -> None:
        """Run the gathered batch (marked in flight for /healthz and the in-flight gauge)."""
        batch, self._gathered = self._gathered, []
        if not batch:
            return
        consumer = self.consumer
        consumer.delivering_since = self._started = time.monotonic()
        try:
            if self.port.stopping or consumer.handing_back:
                for item in batch:
                    self.acks.hand_back(item.delivery, item.message.id)
                return
            self.tally.sizes.observe(len(batch))
            if len(batch) == 1:  # alone already: the per-message path, exactly
                self._alone(batch[0])
            else:
                self._span = self.tracing.batch([item.delivery for item in batch])
                self._run_batch(batch)
        except connection_errors():
            raise  # the broker is gone: the consumer reconnects; the broker requeues
        except Exception as exc:
            log.exception("port %s: container error in a batch of %d", self.port.name, len(batch))
            for item in batch:
                if not item.delivery.acknowledged:
                    self.acks.failed(item.delivery)
            self.port.stop_for_failures(batch[0].message.id, exc, internal=True)
        finally:
            self._span.end()
            consumer.delivering_since = None
            consumer.alive_at = time.monotonic()

    def _items(self, batch: list[_Gathered]) -> list[BatchItem]:
        return [BatchItem(g.message, g.argument, self._mover(g.delivery)) for g in batch]

    def _mover(self, delivery: Delivery) -> Any:
        return lambda queue, reason: self.backout.copy(delivery, queue, reason, 0, None)

    def _run_batch(self, batch: list[_Gathered]) -> None:
        started = time.perf_counter()
        crash_point("before-handler")
        items = self._items(batch)
        outcome = self._through_outages(lambda: self.runner.run(items, hold=self._hold),
                                        failed=lambda o: o.kind == "infrastructure")
        if outcome is _GAVE_UP:
            for item in batch:
                self.acks.hand_back(item.delivery, item.message.id)
            return
        self.tally.handler.observe(time.perf_counter() - started)
        if outcome.kind in ("failed", "conflict"):
            self._fall_back(batch, outcome)
        else:
            self._settle_batch(batch, outcome)

    def _hold(self, call: Callable[[], Outcome]) -> Outcome | None:
        """One message of a batch without a transaction, held through a database outage as alone."""
        outcome = self._through_outages(call, failed=lambda o: o.kind == "infrastructure")
        return None if outcome is _GAVE_UP else outcome

    def _fall_back(self, batch: list[_Gathered], outcome: BatchOutcome) -> None:
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
            self._alone(item)
            crash_point("mid-acks")

    def _alone(self, item: _Gathered) -> None:
        self._argument = item.argument
        span = self.tracing.process(item.delivery)  # alone: the message's own span
        try:
            self.tracing.counted(item.message.redelivery_count)
            super()._deliver(item.delivery, item.message)
        finally:
            span.end()

    def _run(self, delivery: Delivery, message: Message) -> Outcome:
        """One message alone: a batch handler gets a list of one; a per-message one runs as ever."""
        if not self.invoker.spec.batch:
            return super()._run(delivery, message)
        result = self.runner.run([BatchItem(message, self._argument, self._mover(delivery))],
                                 client_ack=self.acks.begin(delivery, message.id))
        if result.kind == "conflict" or (result.kind == "handled" and result.duplicates):
            return Outcome("duplicate")
        if result.kind != "handled":
            return Outcome(result.kind, result.error)
        return Outcome("handled", pending=result.pending, direct=[s for _, s in result.direct])

    # -- settling ----------------------------------------------------------

    def _settle_batch(self, batch: list[_Gathered], outcome: BatchOutcome) -> None:
        if outcome.pending:
            try:
                self.resources.outbox.dispatch(self.consumer.publisher, outcome.pending)
            except Exception as exc:  # the rows are committed: the relay sends them later
                log.warning("port %s: outbox publish deferred to the relay: %s",
                            self.port.name, describe(exc))
        failed = dict(outcome.failed)
        for index, error in self._publish_direct(outcome.direct).items():
            if index < 0:  # a batch handler's send: the batch is not done, run each alone
                self._fall_back(batch, BatchOutcome("failed", error))
                return
            failed.setdefault(index, Outcome("failed", error))
        for index in sorted(failed):  # transaction none: a failing message fails alone
            self._failed(batch[index].delivery, batch[index].message, failed[index])
        for index in outcome.held_back:  # the port stopped during an outage: back uncounted
            self.acks.hand_back(batch[index].delivery, batch[index].message.id)
        duplicates = [batch[i] for i in outcome.duplicates]
        for item in duplicates:
            self.acks.discard(item.delivery)
        if duplicates:
            crash_point("mid-acks")
        handled = [batch[i] for i in outcome.handled if i not in failed]
        self.acks.settle_many([item.delivery for item in handled])
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


class AsyncBatchPipeline(BatchPipeline):
    """A batched port with an async handler: the batch path as it is, its units of work awaited
    on the consumer's own event loop (one batch at a time; see docs/architecture.md)."""

    def __init__(self, port: PortView, consumer: ConsumerView) -> None:
        super().__init__(port, consumer)
        self.loop = asyncio.new_event_loop()
        self.async_unit = async_unit_class(self.settings.transaction, self.settings.transaction_attribute)
        self.units = async_resources(self.resources.units, 1, self.async_unit is not AsyncUnitOfWork)
        self.runner = AsyncBatchRunner(port.name, self.resources.units, self.invoker,
                                       transaction=self.settings.transaction,
                                       attribute=self.settings.transaction_attribute,
                                       once_only=self.once_only, loop=self.loop, units=self.units)

    def _run(self, delivery: Delivery, message: Message) -> Outcome:
        if self.invoker.spec.batch:  # a list of one, through the runner
            return super()._run(delivery, message)
        unit = self.async_unit(self.port.name, message.id, self.units, once_only=self.once_only,
                               move_copy=self._mover(delivery))
        return self.async_runner.one(unit, self._argument, MessageContext(message, self.port.name, unit))

    @property
    def async_runner(self) -> AsyncBatchRunner:
        assert isinstance(self.runner, AsyncBatchRunner)
        return self.runner

    def close(self) -> None:
        self.loop.run_until_complete(self.invoker.adiscard())
        with suppress(Exception):
            self.loop.run_until_complete(dispose(self.units))
        self.loop.close()


def pipeline_for(port: PortView, consumer: ConsumerView) -> Pipeline:
    """The per-message pipeline, or the batch pipeline of a batched port."""
    if (port.settings.batch_size > 1 or port.spec.batch) and port.spec.is_async:
        return AsyncBatchPipeline(port, consumer)
    if port.settings.batch_size > 1 or port.spec.batch:
        return BatchPipeline(port, consumer)
    if port.spec.is_async:
        return AsyncPipeline(port, consumer)
    return Pipeline(port, consumer)
