"""AMQP heartbeats on connections whose owner blocks: in ``drain_events``, or in a handler.

py-amqp sends and checks heartbeats only when someone calls for them, and a
consumer thread spends its life either blocked in ``drain_events`` or, inside
it, running a handler for as long as the handler takes. So each connection
gets a :class:`Heartbeat`: its owner ticks it before every drain, and a thread
of its own ticks it whenever the owner is not reading, a long handler above
all. A handler can therefore run for any length of time without its
connection being closed for silence, and a connection whose network went
silent is found dead within two heartbeats on both sides.

py-amqp connections are not thread-safe, so the owner and the thread share
one lock: the owner holds it while it reads from the connection (a drain, a
cancel, a confirm, a transaction commit) and lets go of it only while a
handler runs (:meth:`Heartbeat.away`), or while the owner works between two
reads (a batch the linger flushed: :meth:`Heartbeat.outside`). py-amqp's frame
writer serializes frame writes under a lock of its own (since 5.4.2, the
version ``pyproject.toml`` requires), so a heartbeat written while the handler
acknowledges or publishes is safe.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any, TypeVar

from amqp.exceptions import ConnectionForced

log = logging.getLogger("mdbcontainer.heartbeat")
get_ident = threading.get_ident
T = TypeVar("T")


class Heartbeat:
    """Sends heartbeats on one AMQP connection and declares it dead after two silent intervals."""

    def __init__(self, connection: Any, name: str, *, owner_drains: bool) -> None:
        self._conn = connection  # the py-amqp connection under kombu's
        self.interval = float(getattr(connection, "heartbeat", 0) or 0)
        self.name = name
        self.lock = threading.Lock()
        self._owner_drains = owner_drains
        self._holder: int | None = None  # the owner's thread while it holds the lock
        self._away = False
        now = time.monotonic()
        self._heard_at = self._sent_at = now
        # When a read of the connection last ended: the broker's silence is proven only up to
        # then. An event loop's owner reads between its tasks and holds no lock otherwise, so a
        # handler that blocks the loop leaves the broker's frames unread in the socket.
        self._read_at = now
        self._recv = connection.bytes_recv
        self._sent = connection.bytes_sent
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def start_for(cls, connection: Any, name: str, *, owner_drains: bool) -> Heartbeat | None:
        """A running Heartbeat for a connected kombu connection, or None when it has none.

        ``owner_drains``: the owner reads the connection all the time (a
        consumer). Otherwise (a publisher, idle between publishes) the thread
        reads what the broker sent while the owner is idle, heartbeats included.
        """
        amqp_conn = getattr(connection, "connection", None)
        if not getattr(amqp_conn, "heartbeat", 0) or not hasattr(amqp_conn, "send_heartbeat"):
            return None
        beat = cls(amqp_conn, name, owner_drains=owner_drains)
        beat._thread = threading.Thread(target=beat._run, name=f"mdb-heartbeat-{name}", daemon=True)
        beat._thread.start()
        return beat

    def tick(self) -> None:
        """Send a heartbeat when nothing went out for half an interval; raise when the broker fell silent.

        The caller holds :attr:`lock`. Any frame counts, both ways. While the
        owner is away (a handler runs, nobody reads), what the broker sent waits
        in the socket, so silence is not held against the broker then, nor after
        the last read ended (an async handler that blocks its loop: nobody reads,
        though nobody said so); the kernel still ends the connection if our
        heartbeats go unacknowledged (TCP user timeout, set by the broker seam to
        two heartbeats).
        """
        now = time.monotonic()
        conn = self._conn
        if conn.bytes_recv != self._recv or self._away:
            self._recv, self._heard_at = conn.bytes_recv, now
        if conn.bytes_sent != self._sent:
            self._sent, self._sent_at = conn.bytes_sent, now
        if now - self._sent_at >= self.interval / 2:
            conn.send_heartbeat()
            self._sent, self._sent_at = conn.bytes_sent, now
        silent = self._read_at - self._heard_at
        if silent > 2 * self.interval:
            raise ConnectionForced(
                f"no frame from the broker for {silent:.1f}s (heartbeat {self.interval:g}s): "
                "the connection is dead"
            )

    @contextmanager
    def reading(self) -> Iterator[None]:
        """The owner uses the connection (it may read): hold the lock, tick first."""
        with self.lock:
            holder, self._holder = self._holder, threading.get_ident()
            was_away, self._away = self._away, False
            try:
                self.tick()
                yield
            finally:
                self._away, self._holder = was_away, holder
                self._read_at = time.monotonic()

    def read(self, call: Callable[..., T], *args: Any) -> T:
        """:meth:`reading` around ``call(*args)``, without a generator: a consumer drains once
        per delivery."""
        with self.lock:
            holder, self._holder = self._holder, get_ident()
            was_away, self._away = self._away, False
            try:
                self.tick()
                return call(*args)
            finally:
                self._away, self._holder = was_away, holder
                self._read_at = time.monotonic()

    @contextmanager
    def away(self) -> Iterator[None]:
        """The owner runs a handler inside a drain: let the thread keep the heartbeats going."""
        if self._holder != threading.get_ident():  # not inside reading(): nothing to let go of
            yield
            return
        was_away, self._away = self._away, True
        self._holder = None
        self.lock.release()
        try:
            yield
        finally:
            self._come_back(was_away)

    def away_for(self, call: Callable[[T], None], argument: T) -> None:
        """:meth:`away` around one call, without a generator: the consumer's once per delivery."""
        if self._holder != get_ident():
            call(argument)
            return
        was_away, self._away = self._away, True
        self._holder = None
        lock = self.lock
        lock.release()
        try:
            call(argument)
        finally:  # _come_back, inline
            lock.acquire()
            self._away, self._holder = was_away, get_ident()
            self._heard_at = time.monotonic()  # what arrived meanwhile is read next

    def _come_back(self, was_away: bool) -> None:
        self.lock.acquire()
        self._away, self._holder = was_away, threading.get_ident()
        self._heard_at = time.monotonic()  # what arrived meanwhile is read next

    @contextmanager
    def outside(self) -> Iterator[None]:
        """The owner works between two reads (a batch the linger flushed): as :meth:`away`.

        The owner holds no lock here, so the thread ticks anyway; without this
        it would hold the broker's silence against it (nobody reads meanwhile)
        and kill the connection under a batch that outlasts two heartbeats.
        """
        if self._holder == threading.get_ident():  # inside reading(): let go of the lock instead
            with self.away():
                yield
            return
        with self.lock:
            was_away, self._away = self._away, True
        try:
            yield
        finally:
            with self.lock:
                self._away = was_away
                self._heard_at = time.monotonic()  # what arrived meanwhile is read next

    def _run(self) -> None:
        step = max(0.2, self.interval / 4)
        while not self._stop.wait(step):
            if not self.lock.acquire(timeout=step):
                continue  # the owner is reading: it ticks before each drain
            try:
                if not self._owner_drains and not self._away:
                    self._read_waiting()
                self.tick()
            except Exception as exc:
                self._kill(exc)
                return
            finally:
                self.lock.release()

    def _read_waiting(self) -> None:
        """Read the frames waiting on an idle connection (heartbeats, a close, a blocked notice)."""
        with suppress(socket.timeout, TimeoutError):
            for _ in range(20):  # a few frames at most: an idle connection receives little
                self._conn.drain_events(timeout=0.05)
        self._read_at = time.monotonic()

    def _kill(self, exc: BaseException) -> None:
        """Shut the socket down, so that the owner's next read or write fails and it reconnects."""
        log.warning("broker connection %s: %s", self.name, exc)
        sock = getattr(getattr(self._conn, "transport", None), "sock", None)
        if sock is not None:
            with suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def stop(self) -> None:
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(2.0)


@contextmanager
def using(beat: Heartbeat | None) -> Iterator[None]:
    """``beat.reading()``, or nothing for a connection without heartbeats."""
    if beat is None:
        yield
    else:
        with beat.reading():
            yield


@contextmanager
def outside(beat: Heartbeat | None) -> Iterator[None]:
    """``beat.outside()``, or nothing for a connection without heartbeats."""
    if beat is None:
        yield
    else:
        with beat.outside():
            yield
