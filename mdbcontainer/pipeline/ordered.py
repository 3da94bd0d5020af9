"""The pipeline of an ordered port (``order_by``): one delivery per key at a time, keys side by side.

It is the async pipeline's event loop (``async_single.py``) with two changes:
the deliveries waiting for a task wait in per-key lanes (``lanes.py``), so a
task takes the oldest delivery of a key that has none in flight; and a failed
delivery is not requeued (nor moved to a wait queue, where the key's later
messages would overtake it) but kept by the container, unacknowledged, and
run again after its redelivery delay, first of its key, while the other keys
go on. A synchronous handler's unit of work runs on one of ``concurrency``
worker threads; every acknowledgment still leaves from the loop's thread, the
connection's owner. See docs/guides/ordered-ports.md.

Held keys (``on_backout = "hold"``) are rows of ``state.holds``: written at the
backout, read at start and every ``control_interval`` (so ``mdb port release``
reaches every container of the fleet), deleted when a replay of the
backed-out message arrives, which then runs first.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import sys
import time
from collections.abc import Hashable
from typing import Any

from ..message import Message
from ..sending.replies import mark_consumer_thread
from ..support.failures import describe
from ..support.logs import fields
from ..support.ordering import OrderKey
from ..units.context import MessageContext
from ..units.single import Outcome
from ..wire.delays import came_back, wait_after
from ..wire.delivery import Delivery
from .acknowledge import Seen
from .async_single import AsyncPipeline
from .attempt import Attempt
from .lanes import Lanes, Unkeyed
from .loop import WriteGate
from .single import ConsumerView, PortView

log = logging.getLogger("mdbcontainer.pipeline")

SWITCH_INTERVAL = 0.0005  # seconds


class OrderedPipeline(AsyncPipeline):
    """Runs a port's deliveries one per key at a time, up to ``concurrency`` keys at once."""

    def __init__(self, port: PortView, consumer: ConsumerView) -> None:
        super().__init__(port, consumer)
        assert self.settings.order_by is not None
        self.order = OrderKey(self.settings.order_by)
        self.hold_on_backout = self.settings.on_backout == "hold"
        self.lanes: Lanes[Delivery] = Lanes()
        self._keys: dict[Delivery, Hashable] = {}  # every delivery the pipeline has: its key
        self._again: set[Delivery] = set()  # failed, to run again here: counted as a redelivery
        self._later: dict[Delivery, asyncio.TimerHandle] = {}  # waiting out their redelivery delay
        self.held: dict[str, str] = {}  # held keys: the backed-out message's id
        # The prefetch window is all waiting deliveries: no other key reaches the port (the guide).
        self._full = max(1, self.settings.prefetch - self.limit)
        self._warned_full = False
        self._polled = 0.0
        self._poll_every = self.resources.settings.container.control_interval.total_seconds()
        self._sync = not port.spec.is_async
        self._workers: concurrent.futures.ThreadPoolExecutor | None = None
        self._running: set[concurrent.futures.Future[Outcome]] = set()
        if self._sync:  # a worker thread's transaction never waits on the loop: no gate
            self.gate = WriteGate(False)
        if self._sync and self.limit > 1:
            # Every delivery passes from this thread to a worker and back: with the interpreter's
            # 5 ms switch interval, a busy loop thread keeps a woken worker waiting for the GIL.
            sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL))

    # -- the channel's callback --------------------------------------------

    def __call__(self, delivery: Delivery) -> None:
        """A delivery arrived: into its key's lane (first, if it is the held key's replay)."""
        key = self._key_of(delivery)
        self._keys[delivery] = key
        if isinstance(key, str) and key in self.held and delivery.message_id == self.held[key]:
            self.lanes.front(key, delivery)  # before the release: nothing of the key overtakes it
            self._release(key, "its backed-out message was replayed", forget=True)
            return
        self.lanes.add(key, delivery)
        self._dispatch()
        if self.lanes.waiting >= self._full:
            self._warn_full()

    def _warn_full(self) -> None:
        if self._warned_full:
            return
        self._warned_full = True
        held = ", ".join(sorted(self.held)[:5]) or "none"
        log.warning("port %s: %d deliveries wait for their keys (prefetch %d): no other key reaches "
                    "the port until they move (held keys: %s); raise prefetch above the backlog a "
                    "key may build", self.port.name, self.lanes.waiting, self.settings.prefetch, held,
                    extra=fields(port=self.port.name, outcome="prefetch_full"))

    def _key_of(self, delivery: Delivery) -> Hashable:
        body = delivery.body if self.order.field is not None else None
        key = self.order.of(delivery.headers, body)
        return Unkeyed() if key is None else key

    def _dispatch(self) -> None:
        """Start a task for each ready key while fewer than ``concurrency`` run."""
        while (len(self.tasks) < self.limit and self._broken is None
               and not (self.consumer.handing_back or self.port.stopping)):
            taken = self.lanes.take()
            if taken is None:
                return
            self._start(taken[1])

    async def _serve(self, delivery: Delivery) -> None:
        """Handle ``delivery``, then go on with the next ready key's, while there is one."""
        task = asyncio.current_task()
        assert task is not None
        while True:
            await self._handle(delivery)
            self._ended(delivery)
            if self._broken is not None or self.consumer.handing_back or self.port.stopping:
                return
            taken = self.lanes.take()
            if taken is None:
                return
            delivery = self.tasks[task] = taken[1]

    def _done(self, task: asyncio.Task[None]) -> None:
        self.tasks.pop(task, None)
        self.consumer.alive_at = time.monotonic()
        if not task.cancelled() and (error := task.exception()) is not None:
            self._broken = error  # the broker connection failed under the task: reconnect
        self._dispatch()
        if not self.tasks:
            self.consumer.delivering_since = None

    def _ended(self, delivery: Delivery) -> None:
        """The delivery's fate is decided: its key goes on, unless it runs again after a delay."""
        if delivery in self._later:
            return  # the key stays busy: nothing of it overtakes the failed message
        key = self._keys.pop(delivery, None)
        if key is not None:
            self.lanes.done(key)

    # -- a failure holds its key -----------------------------------------------

    def _requeue(self, delivery: Delivery, failures: int, text: str) -> None:
        """Not back to the queue: kept here, run again after its delay, first of its key."""
        wait = wait_after(self.port.queue_settings, failures).total_seconds()
        self._again.add(delivery)
        self._later[delivery] = self.loop.call_later(wait, self._run_again, delivery)

    def _busy(self) -> bool:
        return bool(self.tasks or self._later)

    def _run_again(self, delivery: Delivery) -> None:
        self._later.pop(delivery, None)
        key = self._keys.get(delivery)
        if key is None:  # handed back meanwhile
            return
        self.lanes.front(key, delivery)
        self.lanes.done(key)
        self._dispatch()

    def _recount(self, attempt: Attempt, message_id: str) -> tuple[int | None, str | None]:
        self._again.discard(attempt.delivery)
        return super()._recount(attempt, message_id)

    def _writes_first(self, delivery: Delivery) -> bool:
        return delivery in self._again or super()._writes_first(delivery)

    def _count(self, attempt: Attempt, message_id: str) -> tuple[int | None, str | None]:
        if attempt.delivery in self._again:  # run again here: a redelivery the broker did not flag
            return self._recount(attempt, message_id)
        return super()._count(attempt, message_id)

    def _back_out(self, attempt: Attempt, reason: str, count: int, exception: str | None,
                  outcome: str = "backed_out") -> None:
        super()._back_out(attempt, reason, count, exception, outcome)
        delivery = attempt.delivery
        key = self._keys.get(delivery)
        if self.hold_on_backout and isinstance(key, str):
            self._hold_key(key, delivery.message_id or "")

    # -- held keys ---------------------------------------------------------------

    def _hold_key(self, key: str, message_id: str) -> None:
        self.held[key] = message_id
        self.lanes.hold(key)
        try:
            self.resources.holds.hold(self.port.name, key, message_id)
        except Exception as exc:  # held here still; another container would not know
            log.warning("port %s: could not record held key %r: %s", self.port.name, key,
                        describe(exc))
        log.warning("port %s: key %r held after the backout of message %s: its later messages "
                    "wait until mdb port release %s %s, or a replay of the message",
                    self.port.name, key, message_id, self.port.name, key,
                    extra=fields(port=self.port.name, message_id=message_id, outcome="held"))

    def _release(self, key: str, why: str, *, forget: bool = False) -> None:
        self.held.pop(key, None)
        self.lanes.release(key)
        if forget:
            try:
                self.resources.holds.release(self.port.name, key)
            except Exception as exc:
                log.warning("port %s: could not delete held key %r: %s", self.port.name, key,
                            describe(exc))
        log.info("port %s: key %r released: %s", self.port.name, key, why,
                 extra=fields(port=self.port.name, outcome="released"))
        self._dispatch()

    def refresh_holds(self) -> None:
        """Take the fleet's held keys from the table: new holds, and keys released by an operator."""
        self._polled = time.monotonic()
        try:
            rows = self.resources.holds.of(self.port.name)
        except Exception as exc:  # the database is away: the holds stay as they are
            log.debug("port %s: held keys not read: %s", self.port.name, describe(exc))
            return
        for key in [k for k in self.held if k not in rows]:
            self._release(key, "released by an operator (mdb port release)")
        for key, message_id in rows.items():
            if key not in self.held:
                self.held[key] = message_id
                self.lanes.hold(key)

    def tick(self) -> None:
        if time.monotonic() - self._polled >= self._poll_every:
            self.refresh_holds()

    # -- a synchronous handler runs on a worker thread -----------------------------

    async def _run_async(self, delivery: Delivery, message: Message, argument: Any) -> Outcome:
        if not self._sync:
            return await super()._run_async(delivery, message, argument)
        invoker = self._invoker()
        self._in_unit.add(delivery)
        try:
            if self.limit == 1:  # one key at a time anyway: on this thread, no hand-off to a worker
                return self._run_inline(delivery, message, argument, invoker)
            future = self._pool().submit(self._run_sync, delivery, message, argument, invoker)
            self._running.add(future)
            future.add_done_callback(self._running.discard)
            return await asyncio.wrap_future(future, loop=self.loop)
        finally:
            self._in_unit.discard(delivery)
            self._free.append(invoker)

    def _run_inline(self, delivery: Delivery, message: Message, argument: Any, invoker: Any) -> Outcome:
        """The unit of work on the loop's thread; its heartbeats go on from theirs meanwhile."""
        sub = self.acks.sub
        if sub is None:
            return self._run_sync(delivery, message, argument, invoker)
        with sub.between_reads():
            return self._run_sync(delivery, message, argument, invoker)

    def _run_sync(self, delivery: Delivery, message: Message, argument: Any, invoker: Any) -> Outcome:
        unit = self.unit_class(
            self.port.name, message.id, self.resources.units, once_only=self.once_only,
            move_copy=lambda queue, reason: self.backout.copy(delivery, queue, reason, 0, None),
        )
        return unit.run(invoker, argument, MessageContext(message, self.port.name, unit))

    def _pool(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._workers is None:
            self._workers = concurrent.futures.ThreadPoolExecutor(
                self.limit, thread_name_prefix=f"mdb-{self.port.name}-worker",
                initializer=mark_consumer_thread, initargs=(self.port.name, self.settings))
        return self._workers

    async def _cancel_all(self, *, only_uncommitted: bool = False) -> None:
        """A synchronous unit of work cannot be cancelled: its task waits for its thread."""
        if not self._sync:
            await super()._cancel_all(only_uncommitted=only_uncommitted)
            return
        tasks = list(self.tasks)
        for task in tasks:
            if self.tasks.get(task) not in self._in_unit:
                task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- the consumer's loop ---------------------------------------------------

    def drive(self, sub: Any, should_run: Any) -> None:
        self.refresh_holds()  # held before the first delivery of a held key arrives
        super().drive(sub, should_run)

    def hand_back_gathered(self) -> None:
        """Graceful stop: every waiting delivery, those waiting out a delay too, back uncounted."""
        for delivery in self._forget_later():
            self.acks.hand_back(delivery, delivery.message_id)
        for delivery in self.lanes.drain():
            self._keys.pop(delivery, None)
            self.acks.hand_back(delivery, delivery.message_id)
        super().hand_back_gathered()

    def _forget_later(self) -> list[Delivery]:
        later, self._later = self._later, {}
        for delivery, handle in later.items():
            handle.cancel()
            self._keys.pop(delivery, None)
            self._again.discard(delivery)
        return list(later)

    def release(self) -> Seen:
        """The channel is gone: what waits goes back with it; wait for the worker threads. What
        waited in the lanes had not started: its hand-back is returned with the rest (counts.py)."""
        self._forget_later()
        waiting = self.lanes.drain()
        self.lanes.clear()
        seen = super().release()
        concurrent.futures.wait(list(self._running))
        self._keys.clear()
        self._again.clear()
        for delivery in waiting:
            opened = not (delivery.redelivered or came_back(delivery))
            (seen.started if opened else seen.unopened).append(delivery.message_id)
        return seen

    def close(self) -> None:
        super().close()
        if self._workers is not None:
            self._workers.shutdown(wait=True)

    def held_keys(self) -> list[dict[str, Any]]:
        """The held keys, for ``mdb ports``: key, backed-out message, deliveries waiting."""
        return [{"key": key, "message_id": message_id, "waiting": self.lanes.waiting_for(key)}
                for key, message_id in sorted(self.held.items())]
