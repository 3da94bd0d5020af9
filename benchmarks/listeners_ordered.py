"""The handler ``benchmarks/ordered.py`` runs inside ``mdb run``: 5 ms of I/O, and a stamp at the end.

Port ``BenchOrdered`` (its settings come from the benchmark: ordered or not,
its concurrency). The handler sleeps ``$BENCH_SLEEP`` seconds (an I/O-bound
call) and counts; at the ``$BENCH_N``-th message it writes, to
``$BENCH_STAMP``, when the first message arrived, when the last message of a
key other than ``hot`` ended, and when the last one ended.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

from mdbcontainer import Message, message_driven

_lock = threading.Lock()
_seen = {"count": 0, "first": 0.0, "last_other": 0.0}
_N = int(os.environ.get("BENCH_N", "0"))
_SLEEP = float(os.environ.get("BENCH_SLEEP", "0.005"))


@message_driven("BenchOrdered")
def bench_ordered(message: Message) -> None:
    began = time.monotonic()
    time.sleep(_SLEEP)
    body: Any = message.body
    with _lock:
        if not _seen["count"]:
            _seen["first"] = began
        _seen["count"] += 1
        now = time.monotonic()
        if body.get("key") != "hot":
            _seen["last_other"] = now
        if _seen["count"] == _N:
            stamp = {"first": _seen["first"], "last_other": _seen["last_other"], "last": now}
            with open(os.environ["BENCH_STAMP"], "w") as out:
                json.dump(stamp, out)
