"""The CPU-bound handler ``benchmarks/scaling.py`` runs in each container process.

Each message costs about a millisecond of pure Python (``$BENCH_SPIN``
iterations of a loop, calibrated by the harness), which holds the GIL: threads
of one process take turns, processes run side by side. Each process notes the
wall-clock time of its first and last handled message, how many it handled
and the CPU time it used in between (all its threads), and writes them to ``$BENCH_DIR/<pid>.txt`` when it exits (the
harness stops the supervisor gracefully once every message is handled), so
that timing costs nothing per message but two ``time.time()`` calls.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from pathlib import Path

from mdbcontainer import Message, MessageContext, message_driven


def spin(iterations: int) -> int:
    """Pure Python work that holds the GIL all along."""
    total = 0
    for i in range(iterations):
        total += i % 7
    return total


class Tally:
    """First and last handled message of this process, and the count."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.count = 0
        self.first = self.last = 0.0
        self.first_cpu = self.last_cpu = 0.0

    def tick(self) -> None:
        now, cpu = time.time(), time.process_time()
        with self.lock:
            if self.count == 0:
                self.first, self.first_cpu = now, cpu
            self.count += 1
            self.last, self.last_cpu = now, cpu

    def write(self) -> None:
        folder = os.environ.get("BENCH_DIR")
        if folder and self.count:  # the supervisor imports this module too, and handles nothing
            cpu = self.last_cpu - self.first_cpu
            Path(folder, f"{os.getpid()}.txt").write_text(f"{self.count} {self.first!r} {self.last!r} {cpu!r}\n")


tally = Tally()
atexit.register(tally.write)
ITERATIONS = int(os.environ.get("BENCH_SPIN", "0"))


@message_driven("BenchCpu")
def on_message(message: Message, ctx: MessageContext) -> None:
    """About 1 ms of pure Python per message."""
    spin(ITERATIONS)
    tally.tick()
