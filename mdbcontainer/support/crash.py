"""Crash points: a test-only switch that kills the process at a named step.

``MDB_CRASH_AT=after-commit`` makes the container SIGKILL itself when a
delivery reaches that step, so tests can prove that no step of the delivery
path loses or duplicates work. ``MDB_CRASH_AT=after-commit:3`` crashes on the
third time the step is reached. With ``MDB_CRASH_ONCE_FILE`` set, the crash
happens only while that file does not exist (it is created just before the
kill), so a restarted container runs on.

``MDB_CRASH_AT=after-commit@Work:3`` counts only the hits on port ``Work``'s
consumer threads (named ``mdb-<port>-<index>``, runtime/port.py; an async
port's deliveries run on its consumer thread's own loop; a batch that runs
on its consumer's batch worker, pipeline/batch.py, on a thread named
``mdb-<port>-<index>-batch_0``), so one process
hosting several ports can be killed exactly at the point of the one named,
with the others' deliveries in flight wherever they are.

The variable is read once at import; with it unset, a crash point costs one
comparison.

In a test's own process (``mdbcontainer.testing.TestContainer.crash``) the
same points are armed with :func:`arm`: the next hit calls the kit's
``on_hit`` instead of SIGKILL. It raises :class:`Killed`, which no step of
the delivery catches (it is not an ``Exception``), so nothing after the point
runs, as in a killed process; the consumer that meets it ends without acking,
handing back or ending its lease, and the kit brings the container back.
"""

from __future__ import annotations

import os
import re
import signal
import threading
from collections.abc import Callable
from pathlib import Path

POINTS = (
    "before-handler",
    "in-handler",
    "after-commit",
    "after-ack",
    "outbox-dispatch",
    "outbox-relay",  # the relay published its rows, not yet removed them
    "mid-backout",
    "mid-replay",
    "before-commit",  # a batch's handlers ran, its outbox rows are written, not yet committed
    "mid-acks",  # some messages of a batch acknowledged, the others not yet
    "before-wait",  # a failure counted, its move to a redelivery wait not yet published
    "mid-wait",  # the copy on the wait queue confirmed, the original not yet acknowledged
)

_name = _port = ""
_thread = re.compile(r"mdb-.+-\d+(-batch_\d+)?")
_target = 1
_once: str | None = None
_hits = 0
_lock = threading.Lock()
ARMED = False  # a hot path may skip its crash-point calls when no test named one
_on_hit: Callable[[str], None] | None = None  # armed in process (arm): called instead of SIGKILL


def read_environment() -> None:
    """Arm the point ``MDB_CRASH_AT`` names (``MDB_CRASH_ONCE_FILE`` too): done once at import.

    A test that sets the variables in its own process calls this rather than reloading the
    module: a reload makes a new :class:`Killed`, which the ``except Killed`` of the modules
    that imported the old one no longer catch."""
    global _name, _port, _thread, _target, _once, _hits, _on_hit, ARMED
    point, _, nth = os.environ.get("MDB_CRASH_AT", "").partition(":")
    with _lock:
        _name, _, _port = point.partition("@")
        # A consumer thread of the port, or its batch worker.
        _thread = re.compile(rf"mdb-{re.escape(_port)}-\d+(-batch_\d+)?")
        _target = int(nth) if nth.isdigit() else 1
        _once = os.environ.get("MDB_CRASH_ONCE_FILE")
        _hits, _on_hit, ARMED = 0, None, bool(_name)


class Killed(BaseException):
    """The process "died" at a crash point armed in process: unwinds the delivery, caught by nobody.

    A ``BaseException``, like ``KeyboardInterrupt``, so that the pipeline's
    ``except Exception`` (a failed delivery, counted and requeued) does not
    take it for a handler's error: a killed process counts nothing and
    acknowledges nothing. Only the consumer thread's loop stops it.
    """


def arm(name: str, on_hit: Callable[[str], None], *, port: str = "") -> None:
    """In this process, call ``on_hit(name)`` at the next hit of point ``name`` (on ``port``'s
    consumers only, when given); it is disarmed before ``on_hit`` runs."""
    global _name, _port, _thread, _target, _hits, _once, _on_hit, ARMED
    if name not in POINTS:
        raise ValueError(f"unknown crash point {name!r}; the points are: {', '.join(POINTS)}")
    with _lock:
        _name, _port, _target, _hits, _once, _on_hit = name, port, 1, 0, None, on_hit
        _thread = re.compile(rf"mdb-{re.escape(port) if port else '.+'}-\d+(-batch_\d+)?")
        ARMED = True


def disarm() -> None:
    """No crash point armed any more (the environment's, if any, is gone too)."""
    with _lock:
        _disarm_locked()


def _disarm_locked() -> None:
    global _name, _on_hit, ARMED
    _name, _on_hit, ARMED = "", None, False


def crash_point(name: str) -> None:
    """SIGKILL this process if the test switch names ``name`` (a no-op otherwise)."""
    global _hits
    if name != _name:
        return
    if (_port or _on_hit) and not _thread.fullmatch(threading.current_thread().name):
        return  # an in-process crash strikes deliveries only, not the housekeeping's relay
    with _lock:
        _hits += 1
        if _hits < _target or name != _name:
            return
        on_hit = _on_hit
        if on_hit is not None:
            _disarm_locked()
    if on_hit is not None:
        on_hit(name)
        return
    if _once:
        marker = Path(_once)
        if marker.exists():
            return
        marker.write_text(name)
    os.kill(os.getpid(), signal.SIGKILL)


read_environment()
