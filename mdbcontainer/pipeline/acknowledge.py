"""Acknowledgment modes (README: JMS reliability mechanisms): when the broker hears that a message is done.

The delivery pipeline decides *whether* a delivery is done; the port's
``acknowledge`` setting decides *when* the broker is told, through one
:class:`Acknowledger` per consumer:

- ``auto``: each message as its handler returns (after its transaction commits). A
  once-only port whose consumer settles its deliveries one after the other, in delivery
  order (the per-message pipeline, sync, not ordered by key), coalesces them: one
  ``basic.ack`` with ``multiple`` for the run of deliveries settled since the last one,
  sent when the consumer is about to wait for the socket, when the run reaches half the
  prefetch (at most 50), or at the first settle a millisecond after the run began
  (:data:`COALESCE_WAIT`). A crash meanwhile redelivers the run, and the dedup table
  absorbs it (no handler runs twice, nothing counts as failed); a lost channel records its
  hand-back, as for everything else the channel held. A port without the dedup table
  acknowledges each message as its handler returns: a crash redelivers at most the one
  whose handler had returned (JMS ``AUTO_ACKNOWLEDGE``).
- ``client``: the handler decides. ``ctx.acknowledge()`` acknowledges this and
  every earlier message of the consumer (AMQP ``basic.ack`` with ``multiple``);
  ``ctx.recover()`` hands every unacknowledged one back to the queue; what is
  still unacknowledged when the port stops or the container exits goes back too.
- ``dups_ok``: lazily, in batches bounded in count (half the prefetch, at most
  50) and in time (1 s), flushed at shutdown. After a crash the unacknowledged
  tail is delivered again: the dedup table absorbs it where ``once_only`` is on.
- ``transacted``: the consumer's channel is transacted (AMQP ``tx.select``).
  Every publish of a delivery (``ctx.send``, ``ctx.reply``, a backout copy) goes
  out on that channel and commits with its acknowledgment, or not at all.

Besides ``settle`` (the mode's "done"), every mode tells the broker the
other fates the pipeline decides: ``discard`` (the message leaves unprocessed:
expired, a duplicate, backed out after its copy was confirmed), ``failed``
(a counted failure, back to its queue) and ``hand_back``.

A message handed back unprocessed (by ``recover()``, a stop, a lost
connection) is recorded as handed back in the delivery counts, here and only
here, so its redelivery is not counted as a failed delivery. After a crash
(SIGKILL) there is no chance to record it: it counts once, as the README's
guarantees say of every message outstanding when its process died.

The modes and the broker seam (``delivery.py``) are the only modules that
acknowledge or reject a message.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..errors import SettingsError
from ..settings import PortSettings
from ..state.counts import DeliveryCounter
from ..support import crash
from ..support.crash import crash_point
from ..support.failures import describe
from ..units.single import ClientAcknowledgment
from ..wire.connection import Capabilities
from ..wire.delays import came_back
from ..wire.delivery import Delivery
from ..wire.subscription import Subscription

log = logging.getLogger("mdbcontainer.acknowledge")

LAZY_INTERVAL = 1.0
LAZY_MAX_BATCH = 50
# ``auto`` on a port that settles in delivery order: how long an acknowledgment may wait for
# the ones after it (it never waits for the socket: the consumer sends it before it waits).
COALESCE_WAIT = 0.001
Held = tuple[Delivery, str]  # a delivery and its message id


@dataclass
class Seen:
    """What a consumer had received and not ended when its channel went (a pipeline's ``release``).

    ``started``: first deliveries, and redeliveries whose count was opened: their
    hand-back closes them. ``unopened``: redeliveries whose count was not opened
    yet: their hand-back opens and closes one delivery, so that an earlier one
    nobody closed (a crash) still counts at the next redelivery (counts.py).
    """

    started: list[str | None] = field(default_factory=list)
    unopened: list[str | None] = field(default_factory=list)


class PortInfo(Protocol):
    """What an acknowledgment mode needs of its port (met by ``port.ListenerPort``)."""

    name: str
    queue: str
    settings: PortSettings

    @property
    def counter(self) -> DeliveryCounter: ...


def check_mode(source: str, port: str, acknowledge: str, caps: Capabilities) -> None:
    """The same refusal for ``mdb check``, which knows the broker's kind without connecting."""
    if acknowledge == "transacted" and not caps.channel_transactions:
        raise SettingsError(
            f"{source}: ports.{port}.acknowledge: 'transacted' needs "
            f"AMQP channel transactions, which the {caps.name} broker does not provide: use "
            "RabbitMQ, or transaction = 'bean' with once_only = true"
        )


def acknowledger_for(port: PortInfo) -> Acknowledger:
    """The strategy of the port (one per consumer)."""
    settings = port.settings
    if settings.acknowledge == "client":
        return ClientAcknowledger(port)
    if settings.acknowledge == "dups_ok":
        return LazyAcknowledger(port, max(1, min(LAZY_MAX_BATCH, settings.prefetch // 2)))
    if settings.acknowledge == "transacted":
        return TransactedAcknowledger(port)
    return Acknowledger(port)


class Acknowledger:
    """``auto``: acknowledge each message as its handler returns."""

    transacted = False
    # Whether :meth:`tick` has work between drains: a mode that holds acknowledgments says so,
    # and the consumer's loop asks only those, not every mode once a drain.
    ticks = False

    def __init__(self, port: PortInfo) -> None:
        self.port = port
        self.sub: Subscription | None = None
        self._current: Held | None = None
        self._held: list[Held] = []
        self._coalesce = 1  # deliveries per acknowledgment (coalesce_in_order)
        self._owed: list[Delivery] = []  # settled, their acknowledgment not yet sent
        self._owed_since = 0.0

    def coalesce_in_order(self) -> None:
        """The pipeline settles every delivery before it takes the next one, in delivery order:
        on a once-only port, acknowledge runs of them with one ``basic.ack`` with ``multiple``.

        Sound only then: the acknowledgment of the latest covers every earlier
        delivery of the channel, and each of those is settled already (its fate
        told to the broker, or owed here). Not for the modes that hold or
        commit (client, dups_ok, transacted), nor for pipelines that run
        deliveries side by side (async, ordered by key) or gather them (batches);
        nor without the dedup table, which absorbs what a crash redelivers.
        """
        if type(self) is Acknowledger and self.port.settings.is_once_only:
            self._coalesce = max(1, min(LAZY_MAX_BATCH, self.port.settings.prefetch // 2))

    def attach(self, sub: Subscription) -> None:
        """A new channel; whatever the previous one held went back to the queue with it."""
        self.sub = sub
        self._held = []
        self._owed = []

    def deliver(self, pipeline: Callable[[Delivery], None]) -> Callable[[Delivery], None]:
        """The channel's message callback (the transacted mode commits after each delivery)."""
        return pipeline

    def begin(self, delivery: Delivery, message_id: str) -> ClientAcknowledgment | None:
        """A delivery enters its unit of work; returns its ``ctx.acknowledge()`` hooks, if any."""
        self._current = (delivery, message_id)
        return None

    def settle(self, delivery: Delivery) -> None:
        """The delivery is done (its work committed): acknowledge it, now or later.

        The crash point ``after-ack`` is reached as the broker is told (for the
        modes that hold or commit, as the mode took the delivery).
        """
        if self._coalesce == 1:
            delivery.ack()
            if crash.ARMED:
                crash_point("after-ack")
            return
        owed = self._owed
        now = time.monotonic()
        if not owed:
            self._owed_since = now
        owed.append(delivery)
        if len(owed) >= self._coalesce or now - self._owed_since >= COALESCE_WAIT:
            self.flush_owed()

    def flush_owed(self) -> None:
        """Send the acknowledgment owed (coalesce_in_order): one ``basic.ack`` with ``multiple``.

        The consumer calls it before it waits for the socket, so an
        acknowledgment never waits for the next delivery to come.
        """
        owed = self._owed
        if not owed:
            return
        owed[-1].ack(multiple=len(owed) > 1)
        self._owed = []  # not before: a channel lost meanwhile records their hand-back (release)
        if crash.ARMED:
            for _ in owed:
                crash_point("after-ack")

    def settle_many(self, deliveries: list[Delivery], *, one_by_one: bool = False) -> None:
        """A batch is done (its work committed): one ``basic.ack`` with ``multiple`` on its last.

        The batch's deliveries are the channel's only unsettled ones up to the
        last: everything delivered before them was settled when its fate was
        decided (expired, a duplicate, backed out, failed, handed back), so the
        one acknowledgment covers exactly the batch. Only ``auto`` batches.
        """
        if one_by_one:  # earlier deliveries are still held (an ordered port's waiting keys)
            for delivery in deliveries:
                delivery.ack()
        elif deliveries:
            deliveries[-1].ack(multiple=True)

    def discard(self, delivery: Delivery) -> None:
        """The message leaves its queue unprocessed (expired, a duplicate, backed out): now."""
        delivery.ack()

    def failed(self, delivery: Delivery) -> None:
        """A failed delivery (already counted) goes back to its queue."""
        delivery.requeue()

    def hand_back(self, delivery: Delivery, message_id: str | None, *, counted: bool = True) -> None:
        """Return an unprocessed delivery without counting it: record first, then requeue.

        ``counted=False``: handed back before step 4 (a redelivery's count not opened yet).
        """
        ids = [message_id] if message_id else []
        if not counted and (delivery.redelivered or came_back(delivery)):
            self._record_hand_back([], ids)
        else:
            self._record_hand_back(ids)
        delivery.requeue()

    def consumed(self, delivery: Delivery) -> bool:
        """True when a failed delivery was already acknowledged (client mode): it cannot go back."""
        return False

    def tick(self) -> None:
        """Called between drains: time-bounded work (the lazy mode's flush)."""

    def close(self) -> None:
        """Graceful stop, channel still open: flush, or hand back what is held."""
        self.flush_owed()

    def release(self, seen: Seen) -> None:
        """The channel is closing or lost: the broker requeues what is held, and what the
        pipeline had ``seen`` and not ended (its ``release``).

        Their hand-back is recorded, so that their redelivery counts nothing even
        while a death on the queue is evidence (counts.py). A competing consumer
        may receive them before this record: then the connection's lease, still
        open with its holder alive, says so.
        """
        held, self._held = self._held, []
        owed, self._owed = self._owed, []  # handled, their acknowledgment lost with the channel
        started = [i for i in [*seen.started, *(message_id for _, message_id in held),
                               *(delivery.message_id for delivery in owed)] if i]
        self._record_hand_back(started, [i for i in seen.unopened if i])

    def _record_hand_back(self, ids: list[str], unopened: list[str] | None = None) -> None:
        if not ids and not unopened:
            return
        port = self.port
        try:
            port.counter.hand_back(port.queue, ids, unopened=unopened or [])
        except Exception as exc:  # the database is away: those messages may count once more
            log.warning("port %s: could not record %d hand-back(s): %s", port.name,
                        len(ids) + len(unopened or []), describe(exc))


class ClientAcknowledger(Acknowledger):
    """``client``: the handler acknowledges; unacknowledged messages are held, then handed back."""

    def __init__(self, port: PortInfo) -> None:
        super().__init__(port)
        self._recovering = False
        self._warned = False

    def begin(self, delivery: Delivery, message_id: str) -> ClientAcknowledgment:
        self._current = (delivery, message_id)
        self._recovering = False
        return _ClientCalls(self, delivery)

    def acknowledge(self, delivery: Delivery) -> None:
        """basic.ack with multiple: this message and every earlier one of this channel."""
        if not delivery.acknowledged:
            delivery.ack(multiple=True)
        held = [item[0] for item in self._held]
        self._held = self._held[held.index(delivery) + 1:] if delivery in held else []
        self._recovering = False

    def recover(self) -> None:
        """Hand back every held message now, and the current one when its handler returns.

        Not AMQP basic.recover: that would also requeue the prefetched messages
        this consumer is about to process, whose delivery tags would then be
        stale. Each held message is rejected with requeue instead; a classic
        queue puts it back in its place.
        """
        held, self._held = self._held, []
        self._hand_back(held)
        self._recovering = True

    def settle(self, delivery: Delivery) -> None:
        assert self._current is not None and self._current[0] is delivery
        if delivery.acknowledged:
            pass
        elif self._recovering:
            self._hand_back([self._current])
        else:
            self._held.append(self._current)
            self._warn_if_starving()
        crash_point("after-ack")

    def consumed(self, delivery: Delivery) -> bool:
        return delivery.acknowledged

    def close(self) -> None:
        held, self._held = self._held, []
        self._hand_back(held)

    def _hand_back(self, items: list[Held]) -> None:
        """Record first, then requeue: the redelivery must find the attempt closed."""
        self._record_hand_back([message_id for _, message_id in items])
        for delivery, _ in items:
            delivery.requeue()

    def _warn_if_starving(self) -> None:
        prefetch = self.port.settings.prefetch
        if len(self._held) >= prefetch and not self._warned:
            self._warned = True
            log.warning(
                "port %s: %d messages held unacknowledged (prefetch %d): the consumer receives "
                "nothing more until the handler calls ctx.acknowledge()",
                self.port.name, len(self._held), prefetch,
            )


class LazyAcknowledger(Acknowledger):
    """``dups_ok``: acknowledge in batches (count or time), with one multiple ack each."""

    ticks = True

    def __init__(self, port: PortInfo, batch: int, interval: float = LAZY_INTERVAL) -> None:
        super().__init__(port)
        self.batch = batch
        self.interval = interval
        self._since = 0.0

    def settle(self, delivery: Delivery) -> None:
        assert self._current is not None and self._current[0] is delivery
        if not self._held:
            self._since = time.monotonic()
        self._held.append(self._current)
        if len(self._held) >= self.batch:
            self.flush()
        crash_point("after-ack")

    def tick(self) -> None:
        if self._held and time.monotonic() - self._since >= self.interval:
            self.flush()

    def flush(self) -> None:
        """One basic.ack with multiple on the latest message covers the whole batch."""
        if self._held:
            delivery, _ = self._held[-1]
            delivery.ack(multiple=True)
            self._held = []

    def close(self) -> None:
        self.flush()


class TransactedAcknowledger(Acknowledger):
    """``transacted``: publishes and the acknowledgment of a delivery commit together.

    The subscription opens its channel with ``tx.select`` before consuming; the
    consumer publishes on that channel (see ``Consumer.publish``), and every
    delivery ends with ``tx.commit``. A failed delivery publishes nothing (its
    sends are discarded) and its requeue is what commits, so the message is
    redelivered; a publish that fails half-way rolls the channel back.
    """

    transacted = True

    def deliver(self, pipeline: Callable[[Delivery], None]) -> Callable[[Delivery], None]:
        def deliver_and_commit(delivery: Delivery) -> None:
            pipeline(delivery)
            self.commit()

        return deliver_and_commit

    def commit(self) -> None:
        assert self.sub is not None
        crash_point("before-tx-commit")
        self.sub.commit()

    def publish(self, **publish: Any) -> None:
        """Publish inside the channel's transaction; a failure discards what it published so far."""
        assert self.sub is not None
        try:
            self.sub.publish(**publish)
        except Exception:
            with suppress(Exception):  # a broken channel has discarded the transaction anyway
                self.sub.rollback()
            raise


class _ClientCalls:
    """``ctx.acknowledge()`` and ``ctx.recover()`` bound to one delivery, wherever they are called."""

    __slots__ = ("_delivery", "_mode")

    def __init__(self, mode: ClientAcknowledger, delivery: Delivery) -> None:
        self._mode = mode
        self._delivery = delivery

    def acknowledge(self) -> None:
        self._mode.acknowledge(self._delivery)

    def recover(self) -> None:
        self._mode.recover()
