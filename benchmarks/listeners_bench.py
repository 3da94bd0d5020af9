"""The handlers ``benchmarks/throughput.py`` runs inside ``mdb run``, and its measuring hooks.

The handlers do the same trivial work as the hand-written consumers they are
compared with; the only extra is an in-process counter that writes the
elapsed time (and the consumer thread's CPU time, its batch worker's included) from the first message
to the N-th to ``$BENCH_STAMP``.

Hooks, off unless their variable is set (the timed runs leave them off):

- ``BENCH_TRACE=DIR``: every new database connection writes a libpq protocol
  trace to a file in DIR, from which the harness counts round trips
  (``ReadyForQuery``) and statements per message;
- ``BENCH_PROFILE=FILE``: cProfile of the consumer thread from the first
  message to the N-th, dumped to FILE (pstats format). Its clock is the
  thread's CPU time, so time the thread spent waiting for a core on a
  loaded machine (or blocked in a socket) is not charged to a function.

The harness reads the traces with :func:`trace_sizes` and :func:`count_trace`.
"""

from __future__ import annotations

import asyncio
import collections
import cProfile
import itertools
import os
import re
import threading
import time
from pathlib import Path
from typing import Any

from sqlalchemy import Column, Integer, MetaData, String, Table, event
from sqlalchemy.pool import Pool

from mdbcontainer import BatchContext, Message, MessageContext, message_driven

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


def _cpu_clocks() -> list[int]:
    """The CPU clocks of the thread running the handler and, when that is a consumer's batch
    worker (``<consumer thread>-batch_0``: a batched port runs its units of work there while
    the consumer receives), of its consumer thread: together, the consumer's CPU."""
    me = threading.current_thread()
    threads = [me]
    consumer, _, _ = me.name.rpartition("-batch_")
    threads += [t for t in threading.enumerate() if consumer and t.name == consumer]
    return [time.pthread_getcpuclockid(t.ident or 0) for t in threads]


def _cpu(clocks: list[int]) -> float:
    return sum(time.clock_gettime(c) for c in clocks)


class Clock:
    """Counts handled messages; writes the first-to-N-th elapsed seconds to ``$BENCH_STAMP``."""

    def __init__(self, *, process_cpu: bool = False) -> None:
        self.process_cpu = process_cpu  # a port of many threads: the process's CPU, not one thread's
        self.target = int(os.environ.get("BENCH_N", "0"))
        self.stamp = os.environ.get("BENCH_STAMP", "")
        self.profile_path = os.environ.get("BENCH_PROFILE", "")
        self.profiler: cProfile.Profile | None = None
        self.count = 0
        self.first = self.first_cpu = 0.0
        self.clocks: list[int] = []

    def start(self) -> None:
        self.clocks = [] if self.process_cpu else _cpu_clocks()
        self.first, self.first_cpu = time.perf_counter(), self.cpu()
        if self.profile_path:
            self.profiler = cProfile.Profile(time.thread_time)
            self.profiler.enable()

    def cpu(self) -> float:
        return time.process_time() if self.process_cpu else _cpu(self.clocks)

    def tick(self, handled: int = 1) -> None:
        """Called as a handler finishes its work (the container commits and acks after it)."""
        before, self.count = self.count, self.count + handled
        if not before < self.target <= self.count or not self.stamp:
            return
        elapsed, cpu = time.perf_counter() - self.first, self.cpu() - self.first_cpu
        if self.profiler is not None:
            self.profiler.disable()
            self.profiler.dump_stats(self.profile_path)
        written = Path(self.stamp + ".part")  # renamed whole: the harness never reads half of it
        written.write_text(f"{elapsed!r} {cpu!r}\n")
        written.replace(self.stamp)


clock = Clock()
many = Clock(process_cpu=True)  # BenchOnceMany's: sixteen consumer threads tick it
many_lock = threading.Lock()
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


@message_driven("BenchOnceMany")
def on_once_many(message: Message, ctx: MessageContext) -> None:
    """``BenchOnce``'s handler on a port of ``concurrency = 16``: how far concurrent consumers'
    commits scale beyond one (PostgreSQL alone, pgbench: 1,270 tx/s with one client, 4,560
    with 16)."""
    ctx.session.execute(effects.insert().values(message_id=message.id, n=work(message.body)))
    with many_lock:
        if many.count == 0:
            many.start()
        many.tick()


@message_driven("BenchOnceBatched")
def on_once_batched(message: Message, ctx: MessageContext) -> None:
    """The same per-message handler as ``BenchOnce``, on a port with ``batch_size = 100``."""
    if clock.count == 0:
        clock.start()
    ctx.session.execute(effects.insert().values(message_id=message.id, n=work(message.body)))
    clock.tick()


@message_driven("BenchBatch", batch=True)
def on_batch(messages: list[Message], ctx: BatchContext) -> None:
    """A batch handler, once-only CMT: one bulk insert of the whole batch's rows."""
    if clock.count == 0:
        clock.start()
    ctx.session.execute(bulk_insert(), {"ids": [m.id for m in messages],
                                        "ns": [work(m.body) for m in messages]})
    latency.observe(messages)
    clock.tick(len(messages))


# -- async handlers (benchmarks/async_handlers.py) --------------------------------------

WAIT = 0.02  # the I/O wait of the I/O-bound handlers (an HTTP call, say)


@message_driven("BenchAsyncNone")
async def on_async_none(message: Message, ctx: MessageContext) -> None:
    """The trivial work of ``BenchNone``, in an ``async def``."""
    if clock.count == 0:
        clock.start()
    work(message.body)
    clock.tick()


@message_driven("BenchAsyncSleep")
async def on_async_sleep(message: Message, ctx: MessageContext) -> None:
    """I/O-bound, ``transaction = "none"``: awaits a 20 ms wait."""
    if clock.count == 0:
        clock.start()
    await asyncio.sleep(WAIT)
    work(message.body)
    clock.tick()


@message_driven("BenchAsyncOnce")
async def on_async_once(message: Message, ctx: MessageContext) -> None:
    """I/O-bound, once-only CMT: a 20 ms wait, then the row through the ``AsyncSession``."""
    if clock.count == 0:
        clock.start()
    await asyncio.sleep(WAIT)
    await ctx.session.execute(effects.insert().values(message_id=message.id, n=work(message.body)))
    clock.tick()


@message_driven("BenchSyncSleepOnce")
def on_sync_sleep_once(message: Message, ctx: MessageContext) -> None:
    """The same handler as ``BenchAsyncOnce`` written synchronously (a blocking 20 ms wait)."""
    if clock.count == 0:
        clock.start()
    time.sleep(WAIT)
    ctx.session.execute(effects.insert().values(message_id=message.id, n=work(message.body)))
    clock.tick()


_bulk: list[Any] = []


def bulk_insert() -> Any:
    """One INSERT of the whole batch's rows from two arrays (PostgreSQL ``unnest``), built once:
    an executemany would send a statement per row, and a multi-row VALUES compiles per call."""
    if not _bulk:
        from sqlalchemy import text

        table = f'"{effects.schema}".bench_effects' if effects.schema else "bench_effects"
        _bulk.append(text(f"INSERT INTO {table} (message_id, n) "
                          "SELECT * FROM unnest(CAST(:ids AS varchar[]), CAST(:ns AS integer[]))"))
    return _bulk[0]


class Latency:
    """``BENCH_LATENCY=FILE``: per message, now minus the ``sent`` epoch in its body, as the
    batch handler runs (so it includes the linger, not the commit that follows)."""

    def __init__(self) -> None:
        self.path = os.environ.get("BENCH_LATENCY", "")
        self.samples: list[float] = []

    def observe(self, messages: list[Message]) -> None:
        if not self.path:
            return
        now = time.time()
        self.samples += [now - float(m.body["sent"]) for m in messages if "sent" in m.body]
        if len(self.samples) >= clock.target:
            Path(self.path).write_text("\n".join(f"{x:.6f}" for x in self.samples))


latency = Latency()


# -- reading the traces (in the harness) -----------------------------------------------

def trace_sizes(folder: Path | None, marks: dict[Path, int] | None = None) -> dict[Path, int]:
    """Sizes of the trace files; with ``marks``, cut every file to what was written since them."""
    sizes = {p: p.stat().st_size for p in folder.glob("*.trace")} if folder else {}
    for path, size in sizes.items() if marks is not None else ():
        data = path.read_bytes()[marks.get(path, 0):size]
        path.with_suffix(".window").write_bytes(data)
    return sizes


QUOTED = re.compile(r'"([^"]*)"')


def count_trace(folder: Path, suffix: str, n: int) -> str:
    """Round trips (ReadyForQuery) per message, and the statements that ran about once a message."""
    trips, statements, names = 0, collections.Counter[str](), {}
    for path in folder.glob(f"*{suffix}"):
        for line in path.read_text(errors="replace").splitlines():
            fields, quoted = line.split("\t"), QUOTED.findall(line)
            kind = (fields[0], fields[2].strip()) if len(fields) > 2 else ("", "")
            trips += kind == ("B", "ReadyForQuery")
            if kind == ("F", "Query") and quoted:
                statements[quoted[0]] += 1
            elif kind == ("F", "Parse") and len(quoted) > 1:  # the unnamed or a prepared statement
                names[quoted[0]] = quoted[1]
            elif kind == ("F", "Bind") and len(quoted) > 1:  # executes the statement it names
                statements[names.get(quoted[1], "?")] += 1
    often = [f"{_label(s)} x{c / n:.2g}" for s, c in statements.most_common() if c >= n / 2]
    return f"{trips / n:.2f} ({', '.join(often) or 'no statement per message'})"


def _label(statement: str) -> str:
    words = re.sub(r'"?bench_[0-9a-f]{8}"?\.', "", statement).split()
    return " ".join(words[:3]) if words else "<empty>"
