"""The pipeline of a port whose handler is ``async def``: one event loop per consumer connection.

The consumer's thread runs the loop and owns the connection, as a blocking
consumer does (py-amqp is not thread-safe): it reads deliveries between the
tasks' steps and every acknowledgment leaves from it. Each delivery is a task
(``concurrency`` of them at most; the rest wait in arrival order), and each
task runs the synchronous pipeline's steps: 1-6 as they are, 7 with an async
unit of work (``units/async_single.py``), 8 as it is. See docs/architecture.md,
"Async handlers".
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from contextlib import suppress
from typing import Any, TypeVar

import tenacity

from ..handlers.registry import Invoker, Running
from ..message import Message
from ..state.database import is_infrastructure
from ..support.crash import crash_point
from ..support.logs import fields
from ..support.retry import DEFAULT as RETRY
from ..units.async_single import AsyncResources, AsyncUnitOfWork, async_resources, async_unit_class, dispose
from ..units.context import MessageContext
from ..units.single import Outcome
from ..wire.connection import connection_errors
from ..wire.delays import came_back
from ..wire.delivery import Delivery
from ..wire.subscription import Subscription
from .acknowledge import Seen
from .attempt import Attempt
from .loop import Watchdog, WriteGate
from .single import _GAVE_UP, ConsumerView, Pipeline, PortView

log = logging.getLogger("mdbcontainer.pipeline")

_IDLE = 0.5  # the longest the loop waits for the socket before it looks at its port again
_POLL = 0.005  # a transport without a socket (the embedded broker) is polled this often while busy
T = TypeVar("T")


class AsyncPipeline(Pipeline):
    """Runs a port's deliveries as tasks on the consumer thread's own event loop."""

    def __init__(self, port: PortView, consumer: ConsumerView) -> None:
        super().__init__(port, consumer)
        self.limit = self.settings.concurrency
        self.async_unit = async_unit_class(self.settings.transaction, self.settings.transaction_attribute)
        self.loop = asyncio.new_event_loop()
        self.tasks: dict[asyncio.Task[None], Delivery] = {}
        self.waiting: deque[Delivery] = deque()
        self._in_unit: set[Delivery] = set()  # deliveries whose unit of work has not ended
        self._counting: set[Delivery] = set()  # deliveries in steps 1-6: a redelivery's count unopened
        self._counted: set[Delivery] = set()  # failures counted, their step 8 not ended
        self._free = [self.invoker]  # bean instances not in use: one task at a time each
        self._invokers = [self.invoker]
        self._units: AsyncResources | None = None
        self._broken: BaseException | None = None
        self._lost = False  # the channel is gone: a cancelled task records its hand-back only
        self._waiter: asyncio.Future[None] | None = None  # the drainer waiting for the socket
        self._readable_now = True  # the socket said it has something (or it is time to look)
        self._shown: Running | None = None  # the call the consumer's ``running`` shows
        self._watched = self.settings.handler_timeout.total_seconds() > 0
        self.watchdog = Watchdog(port.name, port.spec)
        store = self.resources.units.store
        transactional = self.async_unit is not AsyncUnitOfWork
        self.gate = WriteGate(store is not None and store.dialect == "sqlite" and transactional)

    # -- the channel's callback --------------------------------------------

    def __call__(self, delivery: Delivery) -> None:
        """A delivery arrived (inside a drain, on the loop's thread): a task, or wait for one.

        While stopping it waits too: handed back once no task holds a transaction.
        """
        if len(self.tasks) < self.limit and not (self.consumer.handing_back or self.port.stopping):
            self._start(delivery)
        else:
            self.waiting.append(delivery)

    def _start(self, delivery: Delivery) -> None:
        if not self.tasks:
            self.consumer.delivering_since = time.monotonic()
        task = self.loop.create_task(self._serve(delivery))
        self.tasks[task] = delivery
        task.add_done_callback(self._done)

    async def _serve(self, delivery: Delivery) -> None:
        """Handle ``delivery``, then the waiting ones while there are: no task, no done-callback and
        no loop iteration per delivery when the handler does not suspend."""
        task = asyncio.current_task()
        assert task is not None
        while True:
            await self._handle(delivery)
            if not self.waiting or self._broken is not None or self.consumer.handing_back \
                    or self.port.stopping:
                return
            delivery = self.tasks[task] = self.waiting.popleft()

    def _done(self, task: asyncio.Task[None]) -> None:
        self.tasks.pop(task, None)
        self.consumer.alive_at = time.monotonic()
        if not task.cancelled() and (error := task.exception()) is not None:
            self._broken = error  # the broker connection failed under the task: reconnect
        while (self.waiting and len(self.tasks) < self.limit and self._broken is None
               and not (self.consumer.handing_back or self.port.stopping)):
            self._start(self.waiting.popleft())
        if not self.tasks:
            self.consumer.delivering_since = None

    # -- one delivery --------------------------------------------------------

    async def _handle(self, delivery: Delivery) -> None:
        # This delivery's own state, carried through the shared steps (the tasks run side by side);
        # its span is current in this task's context (each task has its own).
        attempt = Attempt(delivery, time.monotonic(), self.tracing.process(delivery))
        counted = False  # steps 1-6 passed: a redelivery's count is open
        try:
            self._counting.add(delivery)
            try:
                message = await self._write_through_outages(lambda: self._prepare(attempt),
                                                            self._writes_first(delivery))  # steps 1-6
            finally:
                self._counting.discard(delivery)
            counted = True
            if message is _GAVE_UP:  # the count's outage outlasted the port: it was not opened
                async with self.gate.writing():
                    self.acks.hand_back(delivery, delivery.message_id, counted=False)
            elif message is not None:
                await self._deliver_async(attempt, message)
        except asyncio.CancelledError:  # a stop that could not wait longer: back, uncounted
            async with self.gate.writing():
                self._cancelled(delivery, counted)
        except connection_errors():
            raise
        except Exception as exc:
            async with self.gate.writing():  # it stops the port: a write on the loop's thread
                self._internal_error(delivery, exc)
        finally:
            attempt.span.end()

    def _writes_first(self, delivery: Delivery) -> bool:
        """Whether steps 1-6 may write: a redelivery's count, and a copy back from a wait is one
        too (its broker flag is off); a hand-back while stopping."""
        return (delivery.redelivered or self.port.stopping or self.consumer.handing_back
                or came_back(delivery))

    async def _write_through_outages(self, call: Callable[[], T], writes: bool = True) -> Any:
        """``call()`` on the loop's thread, behind the write gate when it ``writes``, held while the
        database is away (``_GAVE_UP`` when the port stops meanwhile).

        The waits are awaited, never slept on the loop's thread: the other tasks go on (one may
        hold SQLite's write lock across an await), and so do the connection's heartbeats.
        """
        try:
            async with self.gate.writing(writes):
                return call()
        except Exception as exc:
            if not is_infrastructure(exc):
                raise
            self.resources.outage("database", exc)

        def away(state: tenacity.RetryCallState) -> None:
            if state.outcome is not None and state.outcome.failed:
                self.resources.outage("database", state.outcome.exception())

        async def attempt() -> T:
            async with self.gate.writing(writes):
                return call()

        retrying = RETRY.until_stopped_async(self.port.stop_event, before_sleep=away,
                                             give_up=lambda _state: _GAVE_UP,
                                             retry=tenacity.retry_if_exception(is_infrastructure))
        result: Any = await retrying(attempt)
        if result is not _GAVE_UP:
            self.resources.recovered("database")
        return result

    async def _deliver_async(self, attempt: Attempt, message: Message) -> None:
        started = time.perf_counter()
        crash_point("before-handler")
        delivery, argument = attempt.delivery, attempt.argument
        outcome = await self._through_outages_async(lambda: self._run_async(delivery, message, argument))
        if outcome is not _GAVE_UP and outcome.kind == "failed":
            await self._failed_async(attempt, message, outcome, started)
            return
        writes = outcome is _GAVE_UP or outcome.kind != "handled" or bool(outcome.pending)
        async with self.gate.writing(writes):
            self._conclude(attempt, message, outcome, started)  # step 8, as the synchronous pipeline's

    async def _failed_async(self, attempt: Attempt, message: Message, outcome: Outcome,
                            started: float) -> None:
        """Step 8 of a failed delivery: the synchronous pipeline's ``_failed``, its count held
        through an outage on the loop (awaited, not slept)."""
        async with self.gate.writing():
            self.tally.handler.observe(time.perf_counter() - started)
            text = self._failing(attempt, message, outcome)
        if text is None:
            return
        counted = await self._write_through_outages(
            lambda: self.resources.counter.fail(self.queue, message.id, text))
        delivery = attempt.delivery
        if counted is not _GAVE_UP:  # closed by its count: a lost channel hands nothing back for it
            self._counted.add(delivery)
        try:
            async with self.gate.writing():
                self._after_count(attempt, message, outcome, text, counted)
        finally:
            self._counted.discard(delivery)

    async def _run_async(self, delivery: Delivery, message: Message, argument: Any) -> Outcome:
        unit = self.async_unit(
            self.port.name, message.id, self._resources(), once_only=self.once_only,
            move_copy=lambda queue, reason: self.backout.copy(delivery, queue, reason, 0, None),
        )
        ctx = MessageContext(message, self.port.name, unit)
        invoker = self._invoker()
        self._in_unit.add(delivery)
        try:
            async with self.gate.transaction():
                return await unit.arun(lambda: invoker.acall(argument, ctx))
        finally:
            self._in_unit.discard(delivery)
            self._free.append(invoker)

    async def _through_outages_async(self, call: Callable[[], Any]) -> Any:
        """Hold the delivery while the database is away, as ``_through_outages`` does, awaiting."""
        outcome = await call()
        if outcome.kind != "infrastructure":
            return outcome
        self.resources.outage("database", outcome.error)

        def away(state: tenacity.RetryCallState) -> None:
            if state.outcome is not None and not state.outcome.failed:
                self.resources.outage("database", state.outcome.result().error)

        retrying = RETRY.until_stopped_async(
            self.port.stop_event, before_sleep=away, give_up=lambda _state: _GAVE_UP,
            retry=tenacity.retry_if_exception(is_infrastructure)
            | tenacity.retry_if_result(lambda o: o.kind == "infrastructure"))
        async def attempt() -> Any:  # a coroutine function: tenacity awaits only those
            return await call()

        result: Any = await retrying(attempt)
        if result is not _GAVE_UP:
            self.resources.recovered("database")
        return result

    def _cancelled(self, delivery: Delivery, counted: bool) -> None:
        if not self._lost:  # else released: its hand-back is the consumer's to record (counts.py)
            self.acks.hand_back(delivery, delivery.message_id, counted=counted)

    def _resources(self) -> AsyncResources:
        """The async engine of this loop, made on first use (its connections belong to the loop)."""
        if self._units is None:
            transactional = self.async_unit is not AsyncUnitOfWork
            self._units = async_resources(self.resources.units, self.limit, transactional)
        return self._units

    def _invoker(self) -> Invoker:
        if self._free:
            return self._free.pop()
        invoker = Invoker(self.invoker.spec, self.invoker.adapter, self.invoker.takes_context)
        self._invokers.append(invoker)
        return invoker

    # -- the consumer's loop ---------------------------------------------------

    def drive(self, sub: Subscription, should_run: Callable[[], bool]) -> None:
        """Consume on ``sub`` until ``should_run()`` turns false; then finish, or hand back."""
        if self.invoker.running is self.consumer.running:  # each task's call has its own
            self.invoker.running = Running()
        self.loop.run_until_complete(self._drive(sub, should_run))

    def _show_oldest(self) -> None:
        """The consumer's ``running`` (handler_timeout, /healthz) shows the oldest call in flight."""
        calls = [i.running for i in self._invokers if i.running.since is not None]
        oldest = min(calls, key=lambda r: r.since or 0.0) if calls else None
        shown = self.consumer.running
        if oldest is None:
            shown.since, self._shown = None, None
        elif oldest is not self._shown or shown.since != oldest.since:
            shown.mirror(oldest)
            self._shown = oldest

    async def _drive(self, sub: Subscription, should_run: Callable[[], bool]) -> None:
        self._broken = None
        ticker = self.loop.create_task(self.watchdog.ticking())
        self.watchdog.start(threading.get_ident())
        fd = sub.fileno()
        if fd is not None:
            self.loop.add_reader(fd, self._on_readable)
        try:
            while should_run():
                if self._broken is not None:
                    raise self._broken
                self.consumer.alive_at = time.monotonic()
                if self._watched:
                    self._show_oldest()
                read = sub.drain_ready() if self._readable_now or fd is None else 0
                self._readable_now = False
                self.tick()
                self.acks.tick()
                if read:
                    await asyncio.sleep(0)  # the tasks just started take their first step
                elif fd is not None:
                    await self._readable()
                elif self._busy():
                    await asyncio.sleep(_POLL)
                else:
                    sub.drain(self.wait_limit(_IDLE))
            await self._finish(sub)
        finally:
            if fd is not None:
                self.loop.remove_reader(fd)
            ticker.cancel()
            self.watchdog.stop()

    def _busy(self) -> bool:
        """Whether the loop has work of its own to come back to (a transport without a socket polls)."""
        return bool(self.tasks)

    async def _readable(self) -> None:
        """Until the socket has something to read, or ``_IDLE`` seconds (cheaper than wait_for)."""
        waiter = self._waiter = self.loop.create_future()
        timer = self.loop.call_later(_IDLE, self._on_readable)  # look anyway (a TLS buffer)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None

    def _on_readable(self) -> None:
        self._readable_now = True
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _finish(self, sub: Subscription) -> None:
        """Graceful stop: let running tasks end within shutdown_timeout, then cancel the rest
        (rolled back, handed back uncounted); then hand back what waits."""
        self.consumer.handing_back = True
        sub.cancel()  # deliveries sent before the cancel join the waiting ones
        limit = self.resources.settings.container.shutdown_timeout.total_seconds()
        grace = max(0.0, limit - min(1.0, limit * 0.2))  # cancel before the container gives up
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=grace)
        if self.tasks:
            log.warning("port %s: %d handler(s) still running after %.1fs: cancelled, rolled back "
                        "and handed back", self.port.name, len(self.tasks), grace,
                        extra=fields(port=self.port.name, outcome="cancelled"))
            await self._cancel_all(only_uncommitted=True)
        self.hand_back_gathered()

    async def _cancel_all(self, *, only_uncommitted: bool = False) -> None:
        """Cancel the running tasks (at a stop, only those whose unit of work has not ended:
        one that committed is settled, which takes no longer than a publish)."""
        tasks = list(self.tasks)
        for task in tasks:
            if not only_uncommitted or self.tasks.get(task) in self._in_unit:
                task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def hand_back_gathered(self) -> None:
        waiting, self.waiting = list(self.waiting), deque()
        for delivery in waiting:
            self.acks.hand_back(delivery, delivery.message_id, counted=False)

    def release(self) -> Seen:
        """The channel is gone: waiting deliveries and running tasks go back with it, uncounted;
        what they were is returned, for the consumer to record their hand-back (counts.py)."""
        seen, running = Seen(), set(self.tasks.values())
        for delivery in [*self.waiting, *running]:
            if delivery in self._counted:
                continue
            opened = delivery in running and delivery not in self._counting  # steps 1-6 passed
            if not opened and (delivery.redelivered or came_back(delivery)):
                seen.unopened.append(delivery.message_id)
            else:
                seen.started.append(delivery.message_id)
        self.waiting = deque()
        if self.tasks:
            self._lost = True
            try:
                self.loop.run_until_complete(self._cancel_all())
            finally:
                self._lost = False
        self._broken = None
        return seen

    def close(self) -> None:
        """The consumer ends: tear the beans down, dispose of the async engine, close the loop."""
        for invoker in self._invokers:
            self.loop.run_until_complete(invoker.adiscard())
        with suppress(Exception):
            self.loop.run_until_complete(dispose(self._units))
        self.loop.close()
