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
"""

from __future__ import annotations

import os
import re
import signal
import threading
from pathlib import Path

POINTS = (
    "before-handler",
    "in-handler",
    "after-commit",
    "after-ack",
    "outbox-dispatch",
    "mid-backout",
    "mid-replay",
    "before-commit",  # a batch's handlers ran, its outbox rows are written, not yet committed
    "mid-acks",  # some messages of a batch acknowledged, the others not yet
    "before-wait",  # a failure counted, its move to a redelivery wait not yet published
    "mid-wait",  # the copy on the wait queue confirmed, the original not yet acknowledged
)

_spec = os.environ.get("MDB_CRASH_AT", "")
_point, _, _nth = _spec.partition(":")
_name, _, _port = _point.partition("@")
# A consumer thread of the port, or its batch worker.
_thread = re.compile(rf"mdb-{re.escape(_port)}-\d+(-batch_\d+)?")
_target = int(_nth) if _nth.isdigit() else 1
_once = os.environ.get("MDB_CRASH_ONCE_FILE")
_hits = 0
_lock = threading.Lock()
ARMED = bool(_name)  # a hot path may skip its crash-point calls when no test named one


def crash_point(name: str) -> None:
    """SIGKILL this process if the test switch names ``name`` (a no-op otherwise)."""
    global _hits
    if name != _name:
        return
    if _port and not _thread.fullmatch(threading.current_thread().name):
        return
    with _lock:
        _hits += 1
        if _hits < _target:
            return
    if _once:
        marker = Path(_once)
        if marker.exists():
            return
        marker.write_text(name)
    os.kill(os.getpid(), signal.SIGKILL)
