"""A consumer's frames read in bulk (wire/frames.py) come out as py-amqp would read them.

Over a socket pair: frames cut at every byte, a frame larger than one read,
a wrong frame end, a quiet socket, a closed one, and the bytes read past a
method frame left where py-amqp's own reader goes on from.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from amqp.exceptions import UnexpectedFrame
from amqp.transport import TCPTransport

from mdbcontainer.wire import frames


def frame(kind: int, payload: bytes, channel: int = 1, end: int = 0xCE) -> bytes:
    return struct.pack(">BHI", kind, channel, len(payload)) + payload + bytes([end])


class Connection:
    """What read_until_method uses of a py-amqp connection: its transport and its frame handler."""

    def __init__(self, transport: Any) -> None:
        self.transport = transport
        self.frames: list[tuple[int, int, bytes]] = []

    def on_inbound_frame(self, received: tuple[int, int, bytes]) -> bool:
        self.frames.append(received)
        return received[0] == 1  # a method frame ends the read, as py-amqp's handler says


@contextmanager
def connected() -> Iterator[tuple[Connection, socket.socket]]:
    ours, theirs = socket.socketpair()
    transport = TCPTransport.__new__(TCPTransport)  # its reading half, on our end of the pair
    transport.sock, transport.connected = ours, True
    transport._setup_transport()
    try:
        yield Connection(transport), theirs
    finally:
        ours.close()
        theirs.close()


def test_frames_cut_at_every_byte_arrive_whole_and_in_order() -> None:
    sent = [frame(2, b"header"), frame(3, b"body" * 10), frame(8, b""), frame(1, b"method")]
    with connected() as (conn, broker):
        def dribble() -> None:
            for byte in b"".join(sent):
                broker.send(bytes([byte]))
                time.sleep(0.0005)

        writer = threading.Thread(target=dribble)
        writer.start()
        frames.read_until_method(conn, 10.0)
        writer.join()
    assert conn.frames == [(2, 1, b"header"), (3, 1, b"body" * 10), (8, 1, b""), (1, 1, b"method")]


def test_a_read_stops_at_a_method_frame_and_py_amqp_reads_on_from_there() -> None:
    with connected() as (conn, broker):
        broker.sendall(frame(1, b"first") + frame(1, b"second") + frame(3, b"rest"))
        frames.read_until_method(conn, 1.0)
        assert conn.frames == [(1, 1, b"first")]
        transport = conn.transport
        assert transport.read_frame() == (1, 1, b"second"), "py-amqp's own reader goes on from here"
        assert transport.read_frame() == (3, 1, b"rest")


def test_a_frame_larger_than_one_read_arrives_whole() -> None:
    body = bytes(range(256)) * (3 * frames.CHUNK // 256 + 7)
    with connected() as (conn, broker):
        writer = threading.Thread(target=broker.sendall, args=(frame(3, body) + frame(1, b"m"),))
        writer.start()
        frames.read_until_method(conn, 10.0)
        writer.join()
    assert conn.frames == [(3, 1, body), (1, 1, b"m")]


def test_a_wrong_frame_end_is_refused() -> None:
    with connected() as (conn, broker):
        broker.sendall(frame(1, b"method", end=0x00))
        with pytest.raises(UnexpectedFrame):
            frames.read_until_method(conn, 1.0)


def test_a_quiet_socket_times_out_keeping_a_partial_frame_for_the_next_read() -> None:
    whole = frame(1, b"method")
    with connected() as (conn, broker):
        broker.sendall(whole[:5])
        started = time.monotonic()
        with pytest.raises(socket.timeout):
            frames.read_until_method(conn, 0.2)
        assert 0.15 < time.monotonic() - started < 5.0
        assert conn.frames == []
        assert conn.transport.sock.gettimeout() is None, "the socket is left blocking, as it was"
        broker.sendall(whole[5:])
        frames.read_until_method(conn, 1.0)
    assert conn.frames == [(1, 1, b"method")]


def test_a_closed_socket_ends_the_connection() -> None:
    with connected() as (conn, broker):
        broker.sendall(frame(3, b"body"))
        broker.close()
        with pytest.raises(OSError, match="unexpectedly closed"):
            frames.read_until_method(conn, 1.0)
        assert conn.frames == [(3, 1, b"body")]
        assert conn.transport.connected is False


def test_a_socket_with_a_timeout_of_its_own_is_read_by_py_amqp() -> None:
    with connected() as (conn, broker):
        conn.transport.sock.settimeout(5.0)
        conn.blocking_read = lambda timeout: conn.on_inbound_frame(conn.transport.read_frame())  # type: ignore[attr-defined]
        broker.sendall(frame(3, b"body") + frame(1, b"m") + frame(1, b"later"))
        frames.read_until_method(conn, 1.0)
        assert conn.frames == [(3, 1, b"body"), (1, 1, b"m")]
        assert conn.transport.read_frame() == (1, 1, b"later"), "py-amqp read only what it needed"


def test_an_event_loop_read_handles_every_whole_frame_and_leaves_a_cut_one_for_later() -> None:
    """read_ready (an async port's consumer, woken by its loop): what has come, no waiting."""
    with connected() as (conn, broker):
        whole = frame(1, b"deliver") + frame(2, b"header") + frame(3, b"body")
        cut = frame(1, b"next-deliver")
        broker.sendall(whole + cut[:5])
        time.sleep(0.05)
        started = time.monotonic()
        assert frames.read_ready(conn, 1000) == 3
        assert time.monotonic() - started < 0.5, "nothing more on the socket: no wait"
        assert conn.frames == [(1, 1, b"deliver"), (2, 1, b"header"), (3, 1, b"body")]
        assert frames.read_ready(conn, 1000) == 0, "half a frame is not handled"
        broker.sendall(cut[5:] + frame(3, b"more"))
        time.sleep(0.05)
        assert frames.read_ready(conn, 1) == 1, "the limit holds"
        assert conn.frames[-1] == (1, 1, b"next-deliver")
        assert conn.transport.read_frame() == (3, 1, b"more"), "py-amqp's own reader goes on from here"


def test_an_event_loop_read_of_a_closed_socket_raises() -> None:
    with connected() as (conn, broker):
        broker.close()
        with pytest.raises(OSError):
            frames.read_ready(conn, 1000)
        assert conn.transport.connected is False
