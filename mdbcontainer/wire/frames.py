"""A consumer's AMQP frames read in bulk: one ``recv`` for many deliveries.

py-amqp reads a frame with three ``recv`` calls (its header, its payload,
its end octet), each in a socket timeout it sets and sets back: for a
delivery (method, header and body frames) nine ``recv`` and six
``settimeout`` system calls, where the broker has usually sent the next
dozens of deliveries already. A consumer thread reading its connection
(``Subscription.drain``) reads here instead: whatever the socket holds, up
to :data:`CHUNK` bytes, without waiting (``MSG_DONTWAIT`` on the blocking
socket: one system call, no ``poll`` first), and cuts the frames out of it;
only when not one whole frame is left does it wait for the socket, within
the drain's timeout. On a busy queue that is one system call for a dozen
deliveries or more.

The bytes read and not yet cut into frames stay in py-amqp's own read
buffer (``transport._read_buffer``), and each frame is taken out of it
before it is handled: py-amqp's own reads (a transacted channel's
``tx.commit``, a cancel) go on from exactly where this one stopped, and the
other way round. Each frame goes to py-amqp's frame handler, as its
``blocking_read`` would send it (the connection counts it there, so the
heartbeat sees it). A transport this does not know (TLS keeps its own
buffer) or a socket not in blocking mode is read by py-amqp as before.
"""

from __future__ import annotations

import socket
import sys
import time
from collections.abc import Callable
from struct import Struct
from typing import Any

from amqp.exceptions import UnexpectedFrame
from amqp.transport import TCPTransport

CHUNK = 4096  # bytes per read: a dozen small deliveries; each frame cut out copies the rest once
_HEADER = Struct(">BHI")  # frame type, channel, payload size
_FRAME_END = 0xCE
_DONTWAIT = getattr(socket, "MSG_DONTWAIT", 0)


def read_until_method(amqp_conn: Any, timeout: float,
                      before_wait: Callable[[], None] | None = None) -> None:
    """Read frames until a method frame came (a delivery's is handled then), or ``timeout`` is up.

    Not py-amqp's drain_events: it reads on until a method frame comes, each
    broker heartbeat starting its timeout again, so on a quiet queue it can hold
    the lock for ever and our own heartbeats stop (the broker then closes us).
    ``before_wait`` is called when nothing that has arrived is left to handle,
    before the read waits for more (the consumer sends the acknowledgments it owes).
    """
    sock = _bulk_socket(amqp_conn)
    if sock is None:
        if before_wait is not None:  # py-amqp reads: it may wait at once
            before_wait()
        _by_py_amqp(amqp_conn, timeout)
        return
    _pump(amqp_conn, sock, limit=sys.maxsize, until_method=True, timeout=timeout,
          before_wait=before_wait)


def read_ready(amqp_conn: Any, limit: int) -> int | None:
    """Handle the frames that have already arrived, up to ``limit``, without waiting.

    For an event loop's consumer, woken because the socket is readable: one
    ``recv`` for what the socket holds instead of py-amqp's three reads and two
    timeouts per frame. Returns the frames handled, or None where this reader
    does not apply (TLS, a socket with a timeout): the caller then reads through
    py-amqp.
    """
    sock = _bulk_socket(amqp_conn)
    if sock is None:
        return None
    return _pump(amqp_conn, sock, limit=limit, until_method=False, timeout=None)


def _bulk_socket(amqp_conn: Any) -> socket.socket | None:
    """The blocking plain-TCP socket this reader can read, or None (py-amqp reads then)."""
    transport = getattr(amqp_conn, "transport", None)
    sock = getattr(transport, "sock", None)
    if not _DONTWAIT or type(transport) is not TCPTransport or sock is None or sock.gettimeout() is not None:
        return None
    return sock  # type: ignore[no-any-return]


def _pump(amqp_conn: Any, sock: socket.socket, *, limit: int, until_method: bool,
          timeout: float | None, before_wait: Callable[[], None] | None = None) -> int:
    """Cut whole frames out of py-amqp's read buffer and hand each to its frame handler,
    reading the socket without waiting when none is whole; return the frames handled.

    Stops after ``limit`` frames, after a method frame when ``until_method``, and
    when the socket has nothing more: at once with ``timeout`` None, else after
    waiting up to ``timeout`` seconds for it (TimeoutError).
    """
    transport = amqp_conn.transport
    handle = amqp_conn.on_inbound_frame
    unpack = _HEADER.unpack_from
    deadline = 0.0
    read = 0
    while read < limit:
        buffer = transport._read_buffer
        size = len(buffer)
        if size >= 8:
            frame_type, channel, length = unpack(buffer)
            end = 7 + length
            if size > end:
                if buffer[end] != _FRAME_END:
                    raise UnexpectedFrame(f"Received frame_end {buffer[end]:#04x} while expecting 0xce")
                transport._read_buffer = buffer[end + 1:]  # taken out before anything reads on
                read += 1
                if handle((frame_type, channel, buffer[7:end])) and until_method:
                    return read
                continue
            wanted = max(CHUNK, end + 1 - size)
        else:
            wanted = CHUNK
        try:
            data = sock.recv(wanted, _DONTWAIT)
        except BlockingIOError:  # nothing has come: done, or wait for it as py-amqp would
            if timeout is None:
                return read
            if before_wait is not None:  # once: what it writes gets no answer to read
                before_wait()
                before_wait = None
            if not deadline:
                deadline = time.monotonic() + timeout
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError() from None
            data = _wait_for(transport, sock, wanted, left)
        except OSError:
            transport.connected = False
            raise
        if not data:
            transport.connected = False
            raise OSError("Server unexpectedly closed connection")
        transport._read_buffer += data
    return read


def _wait_for(transport: Any, sock: socket.socket, wanted: int, seconds: float) -> bytes:
    """One ``recv`` that waits up to ``seconds`` (socket.timeout when nothing came)."""
    sock.settimeout(seconds)
    try:
        return sock.recv(wanted)
    except TimeoutError:
        raise
    except OSError:
        transport.connected = False
        raise
    finally:
        sock.settimeout(None)


def _by_py_amqp(amqp_conn: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not amqp_conn.blocking_read(timeout):
        timeout = deadline - time.monotonic()
        if timeout <= 0:
            return
