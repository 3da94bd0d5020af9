"""Throughput of ``mdb run`` against hand-written kombu consumers, on RabbitMQ and PostgreSQL.

Scenarios (each contestant drains the same N persistent messages from a fresh
durable queue, one consumer, prefetch 100):

- ``none``: a kombu ``drain_events`` loop that acks each message, against a
  port with ``transaction = "none"``;
- ``exactly-once``: a naive exactly-once consumer (kombu + SQLAlchemy/psycopg,
  one connection; per message one transaction that claims a dedup row with
  ``INSERT .. ON CONFLICT DO NOTHING RETURNING`` and inserts a business row,
  then the ack), against a port with ``transaction = "container"``,
  ``once_only = true`` whose handler inserts the same row through ``ctx.session``.

The container starts with its port stopped (``mdb port stop``), the queue is
loaded, then ``mdb port start``: start-up and loading are not timed. Each
contestant is timed from its first message to its N-th. Afterwards a short
traced pass (``--trace-n``) counts database round trips per message from the
libpq protocol trace. Run: ``python benchmarks/throughput.py [--n 20000]
[--scenario none|exactly-once|all] [--trace-n 500] [--profile DIR]``.
"""

from __future__ import annotations

import argparse
import collections
import os
import pstats
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import kombu
from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.dialects.postgresql import insert

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
import listeners_bench as lb  # noqa: E402  (benchmarks/ is on sys.path as the script's folder)

from mdbcontainer.store import Tables  # noqa: E402
from mdbcontainer.testing import ContainerProcess, wait_for, write_settings  # noqa: E402

RABBITMQ_URL = "amqp://guest:guest@127.0.0.1:5672//"
POSTGRES_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
PREFETCH = 100
TARGETS = {"none": 0.70, "exactly-once": 0.85}
PORTS = {"none": ("BenchNone", "none"), "exactly-once": ("BenchOnce", "container")}


class BenchError(Exception):
    """A contestant did not drain its messages (the script exits 1)."""


@dataclass
class Result:
    scenario: str
    contestant: str
    n: int
    seconds: float
    round_trips: str = "-"

    @property
    def rate(self) -> float:
        return self.n / self.seconds


class Bench:
    """One run's queue, PostgreSQL schema and scratch folder; close() removes them all."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.tag = uuid.uuid4().hex[:8]
        self.queue = f"bench-{self.tag}"
        self.schema = f"bench_{self.tag}"
        self.tmp = Path(tempfile.mkdtemp(prefix="mdb-bench-"))
        self.engine = create_engine(POSTGRES_URL)
        self.broker = kombu.Connection(RABBITMQ_URL, connect_timeout=5)
        self.loads = 0

    def fresh_schema(self) -> None:
        """An empty schema per contestant, with the baseline's dedup and business tables."""
        with self.engine.begin() as conn:
            conn.execute(text(f'DROP SCHEMA IF EXISTS "{self.schema}" CASCADE'))
            conn.execute(text(f'CREATE SCHEMA "{self.schema}"'))
        Tables.build("bench_", self.schema).dedup.create(self.engine)
        lb.effects_table(self.schema).create(self.engine)

    def load(self, n: int) -> None:
        """Publish n persistent JSON messages with fresh ids; return once the queue holds them."""
        self.loads += 1
        channel = self.broker.channel()
        channel.queue_declare(queue=self.queue, durable=True, auto_delete=False)
        producer = kombu.Producer(channel)
        for i in range(n):
            producer.publish({"n": i, "kind": "bench"}, exchange="", routing_key=self.queue,
                             serializer="json", delivery_mode=2,
                             message_id=f"{self.tag}-{self.loads}-{i}")
        wait_for(lambda: self.ready(channel) == n, 60, 0.1, f"{n} messages on {self.queue}")
        channel.close()

    def ready(self, channel: Any) -> int:
        return int(channel.queue_declare(queue=self.queue, passive=True).message_count)

    def close(self) -> None:
        try:
            channel = self.broker.channel()
            for name in (self.queue, f"{self.queue}.DLQ"):
                channel.queue_delete(queue=name)
        finally:
            self.broker.release()
            with self.engine.begin() as conn:
                conn.execute(text(f'DROP SCHEMA IF EXISTS "{self.schema}" CASCADE'))
            self.engine.dispose()
            shutil.rmtree(self.tmp, ignore_errors=True)


# -- hand-written consumers -------------------------------------------------------------

def kombu_drain(bench: Bench, n: int, handle: Callable[[Any, Any], None]) -> float:
    """One connection, prefetch 100, drain_events; seconds from the first message to the n-th."""
    done, first, last = 0, 0.0, 0.0

    def on_message(body: Any, message: Any) -> None:
        nonlocal done, first, last
        if done == 0:
            first = time.perf_counter()
        handle(body, message)
        done += 1
        if done == n:
            last = time.perf_counter()

    with kombu.Connection(RABBITMQ_URL) as conn:
        queue = kombu.Queue(bench.queue, no_declare=True)
        with conn.Consumer([queue], callbacks=[on_message], prefetch_count=PREFETCH, accept=["json"]):
            while done < n:
                try:
                    conn.drain_events(timeout=30)
                except TimeoutError:
                    raise BenchError(f"kombu consumer idle for 30s after {done}/{n} messages") from None
    return last - first


def plain(body: Any, message: Any) -> None:
    lb.work(body)
    message.ack()


def exactly_once(engine: Engine, schema: str) -> tuple[Callable[[Any, Any], None], Any]:
    """The naive exactly-once handler: one transaction (dedup claim + business row), then ack."""
    dedup, effects = Tables.build("bench_", schema).dedup, lb.effects_table(schema)
    db = engine.connect()

    def handle(body: Any, message: Any) -> None:
        mid = message.properties["message_id"]
        claim = (insert(dedup).values(port="Hand", message_id=mid, processed_at=datetime.now(UTC))
                 .on_conflict_do_nothing(index_elements=[dedup.c.port, dedup.c.message_id])
                 .returning(dedup.c.port))
        with db.begin():
            if db.execute(claim).first() is not None:
                db.execute(effects.insert().values(message_id=mid, n=lb.work(body)))
        message.ack()

    return handle, db


def hand_written(bench: Bench, scenario: str, n: int, trace: Path | None = None) -> float:
    bench.fresh_schema()
    bench.load(n)
    if scenario == "none":
        return kombu_drain(bench, n, plain)
    engine = create_engine(POSTGRES_URL)
    if trace is not None:
        event.listen(engine, "connect", lambda dbapi, _r: lb.trace_connection(dbapi, str(trace)))
    handle, db = exactly_once(engine, bench.schema)
    try:
        return kombu_drain(bench, n, handle)
    finally:
        db.close()
        engine.dispose()


# -- the container ------------------------------------------------------------------------

def mdb(*args: str, env: dict[str, str]) -> None:
    cmd = [sys.executable, "-m", "mdbcontainer", *args]
    done = subprocess.run(cmd, env=env, cwd=HERE, capture_output=True, text=True, timeout=60)
    if done.returncode:
        raise BenchError(f"mdb {' '.join(args)} failed: {(done.stderr or done.stdout).strip()}")


def container(bench: Bench, scenario: str, n: int, *, trace: Path | None = None,
              profile: Path | None = None) -> float:
    """``mdb run`` with its port stopped; load n messages, start the port, wait for the stamp."""
    port = PORTS[scenario][0]
    bench.fresh_schema()
    stamp = bench.tmp / f"{port}-{uuid.uuid4().hex[:6]}.stamp"
    settings = write_settings(bench.tmp / "settings.toml", {
        "container": {"broker_url": RABBITMQ_URL, "database_url": POSTGRES_URL,
                      "listeners": ["listeners_bench"], "db_schema": bench.schema,
                      "dead_letter_queue": f"{bench.queue}.DLQ"},
        "ports": {name: {"destination": bench.queue, "transaction": tx, "concurrency": 1,
                         "prefetch": PREFETCH, "once_only": tx != "none"}
                  for name, tx in PORTS.values()},
    })
    cli_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parent)]),
               "BENCH_SCHEMA": bench.schema}
    env = {**cli_env, "BENCH_N": str(n), "BENCH_STAMP": str(stamp),
           "BENCH_TRACE": str(trace or ""), "BENCH_PROFILE": str(profile or "")}
    config = ["-c", str(settings)]
    mdb("port", "stop", port, *config, env=cli_env)
    proc = ContainerProcess(settings, ports=[port], env=env, cwd=HERE,
                            log_path=bench.tmp / f"{port}.log")
    proc.start(wait=False)
    try:
        wait_for(lambda: _alive(proc) and proc.port_state(port), 60, 0.2, f"mdb run ({port})")
        bench.load(n)
        marks = _trace_sizes(trace)
        mdb("port", "start", port, *config, env=cli_env)
        wait_for(lambda: _alive(proc) and stamp.exists(), 120 + n / 20, 0.1,
                 f"the container to handle {n} messages")
        seconds = float(stamp.read_text())
        if trace is not None:
            _trace_sizes(trace, marks)
        return seconds
    finally:
        if proc.alive():
            try:
                proc.terminate(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def _alive(proc: ContainerProcess) -> bool:
    if not proc.alive():
        raise BenchError(f"mdb run exited:\n{proc.output()[-2000:]}")
    return True


# -- round trips from the libpq trace ---------------------------------------------------

def _trace_sizes(folder: Path | None, marks: dict[Path, int] | None = None) -> dict[Path, int]:
    """Sizes of the trace files; with ``marks``, cut every file to what was written since them."""
    sizes = {p: p.stat().st_size for p in folder.glob("*.trace")} if folder else {}
    for path, size in sizes.items() if marks is not None else ():
        data = path.read_bytes()[marks.get(path, 0):size]
        path.with_suffix(".window").write_bytes(data)
    return sizes


QUOTED = re.compile(r'"((?:[^"\\]|\\.)*)"')


def count_trace(folder: Path, suffix: str, n: int) -> str:
    """Round trips (ReadyForQuery) per message, and the statements that ran about once a message."""
    trips, statements, names = 0, collections.Counter[str](), {}
    for path in folder.glob(f"*{suffix}"):
        for line in path.read_text(errors="replace").splitlines():
            kind = line.split("\t")[2].strip() if line.count("\t") >= 2 else ""
            quoted = QUOTED.findall(line)
            if line.startswith("B") and kind == "ReadyForQuery":
                trips += 1
            elif line.startswith("F") and kind == "Query" and quoted:
                statements[quoted[0]] += 1
            elif line.startswith("F") and kind == "Parse" and len(quoted) >= 2:
                names[quoted[0]] = quoted[1]
            elif line.startswith("F") and kind == "Bind" and len(quoted) >= 2:
                statements[names.get(quoted[1], "?")] += 1
    often = [f"{_label(s)} x{c / n:.2g}" for s, c in statements.most_common() if c >= n / 2]
    return f"{trips / n:.2f} ({', '.join(often) or 'no statement per message'})"


def _label(statement: str) -> str:
    words = re.sub(r'"?bench_[0-9a-f]{8}"?\.', "", statement).split()
    return " ".join(words[:3]) if words else "<empty>"


# -- main ---------------------------------------------------------------------------------

def run_scenario(bench: Bench, scenario: str, trace_n: int, profile: Path | None) -> list[Result]:
    n = bench.n
    results = [Result(scenario, "hand-written", n, hand_written(bench, scenario, n))]
    prof = profile / f"{scenario}.prof" if profile else None
    results.append(Result(scenario, "mdb run", n, container(bench, scenario, n, profile=prof)))
    if trace_n:
        for result, run in zip(results, (hand_written, container), strict=True):
            folder = bench.tmp / f"trace-{scenario}-{result.contestant.replace(' ', '-')}"
            folder.mkdir()
            run(bench, scenario, trace_n, trace=folder)
            suffix = ".window" if run is container else ".trace"
            result.round_trips = count_trace(folder, suffix, trace_n)
    if prof is not None:
        print(f"\n--- cProfile of the {scenario} consumer thread ({prof}; top 25 by own time) ---")
        pstats.Stats(str(prof)).sort_stats("tottime").print_stats(25)
    return results


def report(results: list[Result]) -> None:
    print(f"\n{'scenario':<14}{'contestant':<14}{'msgs/s':>9}{'ratio':>8}  DB round trips/msg")
    base: dict[str, float] = {}
    for r in results:
        ratio = ""
        if r.contestant == "hand-written":
            base[r.scenario] = r.rate
        else:
            value = r.rate / base[r.scenario]
            mark = "ok" if value >= TARGETS[r.scenario] else "MISSED"
            ratio = f"{value:.2f}"
            r.round_trips += f"  [target >= {TARGETS[r.scenario]:.2f}: {mark}]"
        print(f"{r.scenario:<14}{r.contestant:<14}{r.rate:>9,.0f}{ratio:>8}  {r.round_trips}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=20000, help="messages per contestant")
    parser.add_argument("--scenario", choices=["none", "exactly-once", "all"], default="all")
    parser.add_argument("--trace-n", type=int, default=500, help="messages of the traced pass (0: skip)")
    parser.add_argument("--profile", type=Path, metavar="DIR",
                        help="cProfile the container's consumer into DIR (slows it: ratios then mean little)")
    args = parser.parse_args()
    scenarios = ["none", "exactly-once"] if args.scenario == "all" else [args.scenario]
    print(f"N={args.n}, prefetch {PREFETCH}, one consumer; load averages before: {os.getloadavg()}")
    if args.profile:
        args.profile = args.profile.resolve()
        args.profile.mkdir(parents=True, exist_ok=True)
    bench = Bench(args.n)
    try:
        results = [r for s in scenarios for r in run_scenario(bench, s, args.trace_n, args.profile)]
    except (BenchError, AssertionError) as exc:
        print(f"benchmark failed: {exc}", file=sys.stderr)
        return 1
    finally:
        bench.close()
    report(results)
    print(f"\nload averages after: {os.getloadavg()} (2 cores, shared with other work)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
