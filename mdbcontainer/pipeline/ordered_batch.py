"""The batch pipeline of an ordered port: batches of at most one message per key, in delivery order.

A batched ordered port has one consumer, so batches form and settle in
delivery order. A batch holds at most one message of a key (a second one
flushes the batch first), so a message that fails, alone or in the
batch's fallback, has no later message of its key beside it. The failed
message is kept here, unacknowledged, and runs again after its
redelivery delay; meanwhile its key's later messages wait in a lane (the
other keys go on in batches), and are fed in order once it is done. A
held key (``on_backout = "hold"``) keeps its lane until released, as in
``ordered.py``. Waiting deliveries stay unacknowledged, so batches are
acknowledged one message at a time (a ``multiple`` ack would cover them).
See docs/guides/ordered-ports.md.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Hashable
from typing import Any

from ..message import Message
from ..support.failures import describe
from ..support.logs import fields
from ..support.ordering import OrderKey
from ..wire.delays import wait_after
from ..wire.delivery import Delivery
from .acknowledge import Seen
from .async_batch import AsyncBatchPipeline
from .attempt import Attempt
from .batch import BatchPipeline, _Gathered
from .lanes import Unkeyed
from .single import ConsumerView, PortView

log = logging.getLogger("mdbcontainer.pipeline")


class OrderedBatchPipeline(BatchPipeline):
    """Batches that keep each key's order; a failed message holds its key, not the port."""

    keeps_unacknowledged = True

    def __init__(self, port: PortView, consumer: ConsumerView) -> None:
        super().__init__(port, consumer)
        assert self.settings.order_by is not None
        self.order = OrderKey(self.settings.order_by)
        self.hold_on_backout = self.settings.on_backout == "hold"
        self._batch_keys: set[Hashable] = set()  # the keys of the batch being gathered
        self._lanes: dict[Hashable, deque[_Gathered]] = {}  # blocked keys: their later deliveries
        self._retry: dict[Hashable, tuple[float, Delivery]] = {}  # failed: when it runs again
        self._again: set[Delivery] = set()
        self.held: dict[str, str] = {}  # held keys: the backed-out message's id
        self._polled = 0.0
        self._poll_every = self.resources.settings.container.control_interval.total_seconds()

    def _key_of(self, delivery: Delivery) -> Hashable:
        body = delivery.body if self.order.field is not None else None
        key = self.order.of(delivery.headers, body)
        return Unkeyed() if key is None else key

    # -- gathering, one message per key ------------------------------------------

    def _deliver(self, attempt: Attempt, message: Message) -> None:
        self._gather(_Gathered(attempt.delivery, message, attempt.argument), attempt)

    def _gather(self, item: _Gathered, attempt: Attempt | None = None) -> None:
        """Into the batch, unless its key is blocked. ``attempt``: the delivery's own, when it
        arrives now (its span is dropped as it joins); one fed from a lane later has none."""
        key = self._key_of(item.delivery)
        if isinstance(key, str) and key in self.held and item.message.id == self.held[key]:
            self._released(key, "its backed-out message was replayed", forget=True, first=item,
                           attempt=attempt)
            return
        if key in self._batch_keys:
            self.flush()
        if key in self._lanes:  # blocked: after the key's failed message, or held
            self._lanes[key].append(item)
            return
        self._batch_keys.add(key)
        if attempt is None:
            attempt = Attempt(item.delivery, time.monotonic(), argument=item.argument)
        super()._deliver(attempt, item.message)

    def flush(self) -> None:
        """Settle the batch in flight first; a key it blocked keeps its gathered message back."""
        self.settle_in_flight()
        kept = []
        for item in self._gathered:
            key = self._key_of(item.delivery)
            if key in self._lanes:
                self._lanes[key].append(item)
            else:
                kept.append(item)
        self._gathered, self._batch_keys = kept, set()
        super().flush()

    # -- a failure blocks its key ------------------------------------------------

    def _requeue(self, delivery: Delivery, failures: int, text: str) -> None:
        """Kept here, unacknowledged; it runs again after its delay, before its key's next."""
        key = self._key_of(delivery)
        wait = wait_after(self.port.queue_settings, failures).total_seconds()
        self._lanes.setdefault(key, deque())
        self._retry[key] = (time.monotonic() + wait, delivery)
        self._again.add(delivery)

    def _count(self, attempt: Attempt, message_id: str) -> tuple[int | None, str | None]:
        if attempt.delivery in self._again:  # run again here: a redelivery the broker did not flag
            self._again.discard(attempt.delivery)
            return self._recount(attempt, message_id)
        return super()._count(attempt, message_id)

    def _back_out(self, attempt: Attempt, reason: str, count: int, exception: str | None,
                  outcome: str = "backed_out") -> None:
        super()._back_out(attempt, reason, count, exception, outcome)
        delivery = attempt.delivery
        key = self._key_of(delivery)
        if self.hold_on_backout and isinstance(key, str):
            self._hold_key(key, delivery.message_id or "")

    def _run_again(self, key: Hashable, delivery: Delivery) -> None:
        """The failed message again, alone; then its key goes on unless it failed again or is held."""
        attempt = Attempt(delivery, time.monotonic())
        message = self._through_outages(self._prepare, attempt)
        if isinstance(message, Message):
            self._alone(_Gathered(delivery, message, attempt.argument), attempt.started)
        elif message is not None:  # the port stopped while the database was away
            self.acks.hand_back(delivery, delivery.message_id)
        if key not in self._retry and key not in self.held:
            self._feed(list(self._lanes.pop(key, ())))

    def _feed(self, items: list[_Gathered], attempt: Attempt | None = None) -> None:
        """Gather ``items`` in order (``attempt``: the one of an item arriving now, if any)."""
        for item in items:
            self._gather(item, attempt if attempt is not None and attempt.delivery is item.delivery
                         else None)

    # -- the consumer loop's hooks -------------------------------------------------

    def wait_limit(self, idle: float) -> float:
        limit = super().wait_limit(idle)
        if self._retry:
            soonest = min(at for at, _ in self._retry.values())
            limit = min(limit, max(0.0, soonest - time.monotonic()))
        return min(limit, max(0.0, self._polled + self._poll_every - time.monotonic()))

    def due(self) -> bool:
        now = time.monotonic()
        return (super().due() or now - self._polled >= self._poll_every
                or any(at <= now for at, _ in self._retry.values()))

    def tick(self) -> None:
        super().tick()
        now = time.monotonic()
        for key, (at, delivery) in list(self._retry.items()):
            if at <= now and self._retry.get(key) == (at, delivery):
                del self._retry[key]
                self._run_again(key, delivery)
        if now - self._polled >= self._poll_every:
            self.refresh_holds()

    def hand_back_gathered(self) -> None:
        """Graceful stop: also what waits for its key, and the failed messages waiting to run again."""
        super().hand_back_gathered()
        for _at, delivery in self._retry.values():
            self.acks.hand_back(delivery, delivery.message_id)
        for lane in self._lanes.values():
            for item in lane:
                self.acks.hand_back(item.delivery, item.message.id)
        self._forget()

    def release(self) -> Seen:
        """The channel is gone: the blocked keys' later deliveries (counted at gathering) go back
        with the batch's own, their hand-backs returned with them (counts.py)."""
        seen = super().release()
        seen.started += [item.message.id for lane in self._lanes.values() for item in lane]
        self._forget()
        return seen

    def _forget(self) -> None:
        self._retry, self._again, self._batch_keys = {}, set(), set()
        self._lanes = {key: deque() for key in self.held}

    # -- held keys ---------------------------------------------------------------

    def _hold_key(self, key: str, message_id: str) -> None:
        self.held[key] = message_id
        self._lanes.setdefault(key, deque())
        try:
            self.resources.holds.hold(self.port.name, key, message_id)
        except Exception as exc:
            log.warning("port %s: could not record held key %r: %s", self.port.name, key,
                        describe(exc))
        log.warning("port %s: key %r held after the backout of message %s: its later messages "
                    "wait until mdb port release %s %s, or a replay of the message",
                    self.port.name, key, message_id, self.port.name, key,
                    extra=fields(port=self.port.name, message_id=message_id, outcome="held"))

    def _released(self, key: str, why: str, *, forget: bool = False,
                  first: _Gathered | None = None, attempt: Attempt | None = None) -> None:
        self.held.pop(key, None)
        if forget:
            try:
                self.resources.holds.release(self.port.name, key)
            except Exception as exc:
                log.warning("port %s: could not delete held key %r: %s", self.port.name, key,
                            describe(exc))
        log.info("port %s: key %r released: %s", self.port.name, key, why,
                 extra=fields(port=self.port.name, outcome="released"))
        waiting = list(self._lanes.pop(key, ()))
        if key in self._retry:  # a failed message still to run again: the key stays blocked
            self._lanes[key] = deque(([first] if first else []) + waiting)
            return
        self._feed(([first] if first else []) + waiting, attempt)

    def refresh_holds(self) -> None:
        """Take the fleet's held keys from the table (new holds, and releases by an operator)."""
        self._polled = time.monotonic()
        try:
            rows = self.resources.holds.of(self.port.name)
        except Exception as exc:
            log.debug("port %s: held keys not read: %s", self.port.name, describe(exc))
            return
        for key in [k for k in self.held if k not in rows]:
            self._released(key, "released by an operator (mdb port release)")
        for key, message_id in rows.items():
            if key not in self.held:
                self.held[key] = message_id
                self._lanes.setdefault(key, deque())

    def held_keys(self) -> list[dict[str, Any]]:
        """The held keys, for ``mdb ports``: key, backed-out message, deliveries waiting."""
        return [{"key": key, "message_id": message_id, "waiting": len(self._lanes.get(key, ()))}
                for key, message_id in sorted(self.held.items())]


class OrderedAsyncBatchPipeline(OrderedBatchPipeline, AsyncBatchPipeline):
    """An ordered port's batches for an ``async def`` batch handler."""
