"""The handlers ``benchmarks/throughput.py`` runs inside ``mdb run``, and its measuring hooks.

The handlers do the same trivial work as the hand-written consumers they are
compared with; the only extra is an in-process counter that writes the
elapsed time from the first message to the N-th to ``$BENCH_STAMP``.

Hooks, off unless their variable is set (the timed runs leave them off):

- ``BENCH_TRACE=DIR``: every new database connection writes a libpq protocol
  trace to a file in DIR, from which the harness counts round trips
  (``ReadyForQuery``) and statements per message;
- ``BENCH_PROFILE=FILE``: cProfile of the consumer thread from the first
  message to the N-th, dumped to FILE (pstats format).
"""

from __future__ import annotations

import cProfile
import itertools
import os
import time
from pathlib import Path
from typing import Any

from sqlalchemy import Column, Integer, MetaData, String, Table, event
from sqlalchemy.pool import Pool

from mdbcontainer import Message, MessageContext, message_driven

_trace_ids = itertools.count()
_trace_files: list[Any] = []


def effects_table(schema: str | None) -> Table:
    """The business row each exactly-once delivery inserts (the same for both contestants)."""
    return Table(
        "bench_effects", MetaData(schema=schema),
        Column("id", Integer, primary_key=True, autoincrement=True),
        Column("message_id", String(255), nullable=False),
        Column("n", Integer),
    )  # fmt: skip


def work(body: Any) -> int:
    """The trivial work: read the decoded body."""
    return int(body["n"])


def trace_connection(dbapi_connection: Any, directory: str) -> None:
    """Write this psycopg connection's libpq trace to a new file in ``directory``."""
    from psycopg.pq import Trace

    path = Path(directory) / f"{os.getpid()}-{next(_trace_ids)}.trace"
    handle = path.open("w")
    _trace_files.append(handle)  # keep the descriptor open as long as libpq writes to it
    dbapi_connection.pgconn.trace(handle.fileno())
    dbapi_connection.pgconn.set_trace_flags(Trace.SUPPRESS_TIMESTAMPS)


class Clock:
    """Counts handled messages; writes the first-to-N-th elapsed seconds to ``$BENCH_STAMP``."""

    def __init__(self) -> None:
        self.target = int(os.environ.get("BENCH_N", "0"))
        self.stamp = os.environ.get("BENCH_STAMP", "")
        self.profile_path = os.environ.get("BENCH_PROFILE", "")
        self.profiler: cProfile.Profile | None = None
        self.count = 0
        self.first = 0.0

    def start(self) -> None:
        self.first = time.perf_counter()
        if self.profile_path:
            self.profiler = cProfile.Profile()
            self.profiler.enable()

    def tick(self) -> None:
        """Called as a handler finishes its work (the container commits and acks after it)."""
        self.count += 1
        if self.count != self.target or not self.stamp:
            return
        elapsed = time.perf_counter() - self.first
        if self.profiler is not None:
            self.profiler.disable()
            self.profiler.dump_stats(self.profile_path)
        Path(self.stamp).write_text(f"{elapsed!r}\n")


clock = Clock()
effects = effects_table(os.environ.get("BENCH_SCHEMA") or None)
if os.environ.get("BENCH_TRACE"):
    event.listen(Pool, "connect",
                 lambda dbapi, _record: trace_connection(dbapi, os.environ["BENCH_TRACE"]))


@message_driven("BenchNone")
def on_none(message: Message, ctx: MessageContext) -> None:
    """``transaction = "none"``: the trivial work, nothing else."""
    if clock.count == 0:
        clock.start()
    work(message.body)
    clock.tick()


@message_driven("BenchOnce")
def on_once(message: Message, ctx: MessageContext) -> None:
    """``transaction = "container"``, once-only: one Core insert through ``ctx.session``."""
    if clock.count == 0:
        clock.start()
    ctx.session.execute(effects.insert().values(message_id=message.id, n=work(message.body)))
    clock.tick()
