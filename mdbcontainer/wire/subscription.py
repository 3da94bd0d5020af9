"""One consumer: its own connection, channel, prefetch and queue, and how it reads deliveries.

Heartbeats go on from their thread while a handler runs or a batch lingers;
an exclusive subscriber (a durable subscription's one consumer) is enforced by
the broker on RabbitMQ and by a file lock on the embedded broker.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any

import kombu
from amqp.exceptions import AccessRefused

from ..errors import QueueUnavailable
from ..support.failures import describe
from .connection import Broker, node_down
from .delivery import Delivery
from .frames import read_ready, read_until_method
from .heartbeat import Heartbeat, outside, using
from .ownership import OwnerLock, in_use
from .publisher import prepare

log = logging.getLogger("mdbcontainer.broker")


class _ExclusiveQueue(kombu.Queue):  # type: ignore[misc]
    """A queue consumed with AMQP ``exclusive``: the broker refuses every other consumer."""

    def consume(self, consumer_tag: str = "", callback: Any = None, no_ack: Any = None,
                nowait: bool = False, on_cancel: Any = None) -> Any:
        return self.channel.basic_consume(
            queue=self.name, no_ack=self.no_ack if no_ack is None else no_ack,
            consumer_tag=consumer_tag or "", callback=callback, nowait=nowait,
            arguments=self.consumer_arguments, on_cancel=on_cancel, exclusive=True,
        )


class Subscription:
    """One consumer: its own connection, channel, prefetch and queue (README: Processes and threads).

    ``exclusive``: the one active subscriber of a durable subscription (a second
    one gets SubscriptionInUse). ``transacted``: the channel is in AMQP
    transaction mode before it consumes, so its publishes and acknowledgments
    take effect at :meth:`commit`. ``before_wait``: called before a drain waits for the
    socket, with every delivery that had arrived handled.
    """

    def __init__(
        self,
        broker: Broker,
        queue: str,
        prefetch: int,
        on_message: Callable[[Delivery], None],
        declare: Callable[[Any], str | list[str]],
        *,
        exclusive: bool = False,
        transacted: bool = False,
        before_wait: Callable[[], None] | None = None,
    ) -> None:
        self.broker = broker
        self.queue = queue
        self.prefetch = prefetch
        self.on_message = on_message
        self._declare = declare
        self.exclusive = exclusive
        self.transacted = transacted
        self.before_wait = before_wait  # called before a drain waits for the socket
        self.conn: kombu.Connection | None = None
        self.channel: Any = None
        self._consumer: kombu.Consumer | None = None
        self._owner: OwnerLock | None = None
        self._beat: Heartbeat | None = None
        self._closing = False

    def open(self) -> None:
        """Connect, declare and start consuming (raises BrokerUnavailable or a connection error)."""
        self.conn = self.broker.connect_once(heartbeat=True)
        self.channel = self.conn.channel()
        # Bodies stay bytes: py-amqp would decode them by content_encoding, and
        # the pipeline would only encode them again (or fail on a bad encoding).
        self.channel.auto_decode = False
        declared = self._declare(self.channel)  # several: an ordered port's partitions
        names = [declared] if isinstance(declared, str) else declared
        self.queue = names[0]
        self.channel.basic_qos(0, self.prefetch, False)
        if self.transacted:
            self.channel.events["basic_return"].add(self._on_return)
            self.channel.tx_select()
        exclusive = self.exclusive and self.broker.capabilities.exclusive_queues
        if self.exclusive and self.broker.capabilities.local_file:
            self._owner = OwnerLock.for_queue(self.broker.embedded_path, self.queue)
            self._owner.acquire()
        kind = _ExclusiveQueue if exclusive else kombu.Queue
        self._consumer = kombu.Consumer(
            self.channel, queues=[kind(name, no_declare=True) for name in names],
            on_message=self._dispatch, auto_declare=False, accept=None,
        )
        try:
            self._consumer.consume()
        except AccessRefused as exc:
            raise in_use(self.queue, "consumed exclusively by another connection") from exc
        except Exception as exc:
            if node_down(exc):
                raise QueueUnavailable(f"queue {self.queue!r} is unavailable: {describe(exc)}") from exc
            raise
        self._beat = Heartbeat.start_for(self.conn, f"consumer of {self.queue}", owner_drains=True)

    def _dispatch(self, raw: Any) -> None:
        """Run the pipeline on one delivery; heartbeats go on from their thread meanwhile.

        Not while the subscription closes: py-amqp dispatches what arrives while it waits
        for the cancel's and the close's answers, and the pipeline has already let go of
        the channel (its hand-back recorded, what it owed forgotten). A delivery run then
        could be acknowledged, with ``multiple``, past one whose outcome the lost
        connection never told the broker, and that message would be gone. Left
        unacknowledged, the broker requeues it with the channel, as it does every
        prefetched delivery the consumer never read.
        """
        if self._closing:
            return
        if self._beat is None:
            self.on_message(Delivery(raw))
        else:
            self._beat.away_for(self.on_message, Delivery(raw))

    def publish(self, *, exchange: str, routing_key: str, body: bytes,
                properties: dict[str, Any], mandatory: bool) -> None:
        """Publish on the consumer's own channel: with ``transacted``, it leaves at commit()."""
        if self.broker.partitions:
            exchange, routing_key = self.broker.keyed(exchange, routing_key, body, properties)
        with self.broker.tracing.publishing(exchange, routing_key, body, properties) as traced:
            self.channel.basic_publish(prepare(self.channel, body, traced), exchange=exchange,
                                       routing_key=routing_key, mandatory=mandatory)

    def commit(self) -> None:
        """AMQP tx.commit: this delivery's publishes and acknowledgments take effect together."""
        with using(self._beat):
            self.channel.tx_commit()

    def rollback(self) -> None:
        """AMQP tx.rollback: discard this delivery's publishes and acknowledgments."""
        with using(self._beat):
            self.channel.tx_rollback()

    def _on_return(self, exc: Any, exchange: str, routing_key: str, message: Any) -> None:
        # Every queue is declared before a transacted publish, so this is a queue
        # deleted in the meantime; the commit has already happened.
        log.error("transacted publish to %r returned unroutable: %s", exchange or routing_key, exc)

    @contextmanager
    def between_reads(self) -> Iterator[None]:
        """The owner works without reading (a lingered batch): heartbeats go on meanwhile."""
        with outside(self._beat):
            yield

    def drain(self, timeout: float) -> None:
        """Dispatch deliveries for up to ``timeout`` seconds (returns quietly on a quiet queue)."""
        conn = self.conn
        assert conn is not None
        try:  # once per delivery: plain calls, no context manager
            if self._beat is None:
                if self.before_wait is not None:
                    self.before_wait()
                conn.drain_events(timeout=timeout)
            else:
                self._beat.read(read_until_method, conn.connection, timeout, self.before_wait)
        except TimeoutError:  # socket.timeout is TimeoutError
            pass

    def drain_ready(self, limit: int = 1000) -> int:
        """Read what has already arrived, without waiting; return the frames read.

        For an event loop's consumer: py-amqp reads one frame per call (a message
        is three), so this reads until the socket has nothing more, and a frame
        cut in two is completed (py-amqp keeps the part it read).
        """
        assert self.conn is not None
        with using(self._beat):
            fast = read_ready(self.conn.connection, limit)
        if fast is not None:
            return fast
        read = 0
        with using(self._beat), suppress(socket.timeout, TimeoutError):
            while read < limit:
                self.conn.drain_events(timeout=0)
                read += 1
        return read

    def fileno(self) -> int | None:
        """The socket an event loop can watch for deliveries (None: the transport polls)."""
        sock = getattr(getattr(getattr(self.conn, "connection", None), "transport", None), "sock", None)
        try:
            return sock.fileno() if sock is not None else None
        except OSError:
            return None

    def cancel(self) -> None:
        """Stop consuming; deliveries already sent before the cancel still reach ``on_message``."""
        if self._consumer is not None:
            consumer, self._consumer = self._consumer, None
            with suppress(Exception), using(self._beat):
                consumer.cancel()

    def close(self) -> None:
        """Close the connection: the broker requeues whatever is still unacknowledged (and what
        arrives meanwhile is left to that requeue: see :meth:`_dispatch`)."""
        self._closing = True
        self.cancel()
        beat, self._beat = self._beat, None
        if beat is not None:
            beat.stop()
        conn, self.conn, self.channel = self.conn, None, None
        if conn is not None:
            with suppress(Exception):
                conn.close()
        owner, self._owner = self._owner, None
        if owner is not None:
            owner.release()
