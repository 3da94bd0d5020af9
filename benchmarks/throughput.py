"""Throughput of ``mdb run`` against hand-written kombu consumers, on RabbitMQ and PostgreSQL.

Each contestant drains the same N persistent messages from a fresh durable
queue (one consumer, prefetch 100), timed from its first message to its N-th:
``none`` pits a kombu ``drain_events`` loop against a ``transaction = "none"``
port; ``exactly-once`` pits a naive kombu + SQLAlchemy consumer (per message one
transaction: dedup claim, business row, commit, then ack) against a
``transaction = "container"``, ``once_only`` port. The container starts with its
port stopped; the queue is loaded, then ``mdb port start``, so neither start-up
nor loading is timed. A short traced pass (``--trace-n``) counts database round
trips per message from the libpq protocol trace. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import fcntl
import os
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import kombu
from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.dialects.postgresql import insert

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the repository, for a checkout without an editable install
import listeners_bench as lb  # noqa: E402  (the script's own folder is on sys.path)

from mdbcontainer.state.store import Tables  # noqa: E402
from mdbcontainer.testing import ContainerProcess, wait_for, write_settings  # noqa: E402

RABBITMQ_URL = "amqp://guest:guest@127.0.0.1:5672//"
POSTGRES_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
PREFETCH = 100
BATCH = 100
# The targets: each scenario's container against its baseline, on an idle machine.
TARGETS = {"none": 0.90, "exactly-once": 0.85, "batch": 0.90, "batch-per-message": 0.50,
           "none-wire": 0.80, "batch-wire": 0.50, "exactly-once-x16": 3.0}
# The wire's own speed (benchmarks/c_consumer.c on rabbitmq-c): acking each message, and every
# WIRE_ACK_EVERY-th with ``multiple``.
WIRE_ACK_EVERY = 50
# At or above this 1-minute load average before a run, its ratio is no figure: the hand-written
# consumer and the container lose different shares of a core to other work (the CPU column still
# holds). Before each contestant's run the script waits up to IDLE_WAIT seconds for the load to
# fall below it: the runs themselves (RabbitMQ, the consumer, the producer) raise it above 1 on
# two cores, and the 1-minute average takes about a minute to forget them.
MAX_LOAD = 1.0
IDLE_WAIT = 90.0  # --idle-wait
# Every port the container binds (one runs at a time), with its settings.
PORTS: dict[str, dict[str, Any]] = {
    "BenchNone": {"transaction": "none", "prefetch": PREFETCH},
    "BenchOnce": {"transaction": "container", "prefetch": PREFETCH},
    "BenchBatch": {"transaction": "container", "batch_size": BATCH},  # prefetch 2 x batch
    "BenchOnceBatched": {"transaction": "container", "batch_size": BATCH},
    "BenchOnceMany": {"transaction": "container", "concurrency": 16, "prefetch": PREFETCH},
    # benchmarks/async_handlers.py's ports: every handler of listeners_bench needs a
    # destination, or `mdb port stop` refuses the settings.
    "BenchAsyncNone": {"transaction": "none", "prefetch": PREFETCH},
    "BenchAsyncSleep": {"transaction": "none", "concurrency": 100},  # prefetch: raised to 100
    "BenchAsyncOnce": {"transaction": "container", "concurrency": 50, "prefetch": 100},
    "BenchSyncSleepOnce": {"transaction": "container", "prefetch": PREFETCH},
}
# scenario: (baseline, container port). A baseline is a hand-written consumer ("plain":
# kombu, ack per message, no database; "naive": one transaction per message) or a port.
SCENARIOS = {
    "none": ("plain", "BenchNone"),
    "exactly-once": ("naive", "BenchOnce"),
    "batch": ("plain", "BenchBatch"),
    "batch-per-message": ("plain", "BenchOnceBatched"),
    "none-wire": ("c-each", "BenchNone"),
    "batch-wire": ("c-multi", "BenchBatch"),
    "exactly-once-x16": ("BenchOnce", "BenchOnceMany"),
}
WIRE_CONSUMERS = {"c-each": 1, "c-multi": WIRE_ACK_EVERY}  # baseline: acknowledge every k-th
Timing = tuple[float, float]  # wall-clock and consumer-thread CPU seconds, first message to N-th


@contextmanager
def otlp_sink() -> Iterator[str]:
    """An OTLP/HTTP endpoint that takes every export and drops it: what the exporter costs is the
    container's (encoding, posting), what a collector costs is not counted."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Sink(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Sink)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@contextmanager
def services_kept_up() -> Iterator[None]:
    """Hold the machine's disruptive lock shared: runs that stop RabbitMQ or PostgreSQL wait for us."""
    with Path("/tmp/mdb-disruptive.lock").open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            print("waiting for /tmp/mdb-disruptive.lock (a run is stopping a service)", flush=True)
            fcntl.flock(handle, fcntl.LOCK_SH)
        yield


class BenchError(Exception):
    """A contestant did not drain its messages (the script exits 1)."""


@dataclass
class Result:
    scenario: str
    contestant: str
    n: int
    timings: list[Timing] = field(default_factory=list)
    round_trips: str = "-"
    loads: list[float] = field(default_factory=list)  # the 1-minute load average before each run

    @property
    def rates(self) -> list[float]:
        return [self.n / wall for wall, _ in self.timings]

    @property
    def rate(self) -> float:
        return statistics.median(self.rates)

    @property
    def cpu_us(self) -> float:
        """Median CPU microseconds per message of the consumer thread (less sensitive to load)."""
        return statistics.median(cpu / self.n * 1e6 for _, cpu in self.timings)

    def run(self, call: Callable[[], Timing]) -> None:
        """One timed run, once the machine is idle (or waited for long enough): the load
        average before it is recorded."""
        self.loads.append(idle_load(f"{self.contestant} ({self.scenario})"))
        self.timings.append(call())


def idle_load(who: str) -> float:
    """The 1-minute load average, once below MAX_LOAD, waiting up to IDLE_WAIT seconds for it
    (and saying so); the last reading if it stayed at or above MAX_LOAD (no figure, then)."""
    load = os.getloadavg()[0]
    if load < MAX_LOAD or IDLE_WAIT <= 0:
        return load
    print(f"before {who}: waiting up to {IDLE_WAIT:.0f}s for the 1-minute load average "
          f"({load:.2f}) to fall below {MAX_LOAD:g}", flush=True)
    deadline = time.monotonic() + IDLE_WAIT
    while load >= MAX_LOAD and time.monotonic() < deadline:
        time.sleep(min(5.0, max(0.1, deadline - time.monotonic())))
        load = os.getloadavg()[0]
    print(f"  load {load:.2f}" + (" (still loaded: the ratio is no figure)" if load >= MAX_LOAD else ""),
          flush=True)
    return load


class Bench:
    """One run's queue, PostgreSQL schema and scratch folder; close() removes them all."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.tag = uuid.uuid4().hex[:8]
        self.queue = f"bench-{self.tag}"
        self.side = f"bench-{self.tag}-side"  # the hand-written consumer's own queue (--paired)
        self.schema = f"bench_{self.tag}"
        self.tmp = Path(tempfile.mkdtemp(prefix="mdb-bench-"))
        self.engine = create_engine(POSTGRES_URL)
        self.loads = 0
        self.dedup_rows = 0
        self.container_env: dict[str, str] = {}  # --tracing: the OTEL_* variables of mdb run

    def fresh_schema(self) -> None:
        """An empty schema per contestant, with the baseline's dedup and business tables."""
        with self.engine.begin() as conn:
            conn.execute(text(f'DROP SCHEMA IF EXISTS "{self.schema}" CASCADE'))
            conn.execute(text(f'CREATE SCHEMA "{self.schema}"'))
        Tables.build("bench_", self.schema).dedup.create(self.engine)
        lb.effects_table(self.schema).create(self.engine)

    def prefill(self, table: str) -> None:
        """Fill a dedup table with ``--dedup-rows`` old rows of another port, as months of traffic would."""
        if not self.dedup_rows:
            return
        with self.engine.begin() as conn:
            conn.execute(text(
                f'INSERT INTO "{self.schema}".{table} (port, message_id, processed_at) '
                "SELECT 'Old', 'old-' || g, now() - interval '1 day' "
                f"FROM generate_series(1, {int(self.dedup_rows)}) AS g"
            ))
            conn.execute(text(f'ANALYZE "{self.schema}".{table}'))

    def load(self, n: int, *, wait: bool = True, queue: str | None = None) -> None:
        """Publish n persistent JSON messages with fresh ids; return once the queue holds them."""
        self.loads += 1
        queue = queue or self.queue
        with kombu.Connection(RABBITMQ_URL, connect_timeout=5) as conn:
            channel = conn.channel()
            channel.queue_declare(queue=queue, durable=True, auto_delete=False)
            producer = kombu.Producer(channel)
            for i in range(n):
                producer.publish({"n": i, "kind": "bench"}, exchange="", routing_key=queue,
                                 serializer="json", delivery_mode=2,
                                 message_id=f"{self.tag}-{self.loads}-{i}")
            if not wait:  # a running consumer drains it meanwhile
                return
            wait_for(lambda: channel.queue_declare(queue=queue, passive=True).message_count == n,
                     60, 0.1, f"{n} messages on {queue}")

    def close(self) -> None:
        """Remove the queues and the schema, waiting a little for a service that restarts."""
        shutil.rmtree(self.tmp, ignore_errors=True)
        queues = [self.queue, f"{self.queue}.DLQ", self.side]
        try:
            with kombu.Connection(RABBITMQ_URL, connect_timeout=5) as broker:
                broker.ensure_connection(max_retries=10, interval_start=1, interval_max=3)
                channel = broker.channel()
                for name in queues:
                    with contextlib.suppress(Exception):  # --paired only declares the side queue
                        channel = channel if channel.is_open else broker.channel()
                        channel.queue_delete(queue=name)
        except Exception as exc:
            print(f"warning: queues {', '.join(queues)} left on RabbitMQ: {exc}", file=sys.stderr)
        try:
            with self.engine.begin() as conn:
                conn.execute(text(f'DROP SCHEMA IF EXISTS "{self.schema}" CASCADE'))
        except Exception as exc:
            print(f"warning: schema {self.schema} left in PostgreSQL: {exc}", file=sys.stderr)
        self.engine.dispose()


# -- hand-written consumers -------------------------------------------------------------

def kombu_drain(bench: Bench, n: int, handle: Callable[[Any, Any], None],
                profile: Path | None = None, queue: str | None = None) -> Timing:
    """One connection, prefetch 100, drain_events; timed from the first message to the n-th.

    ``profile``: a cProfile of this thread over the same span, on its CPU clock (as the
    container's, see listeners_bench.py), dumped to that file."""
    done, first, last = 0, (0.0, 0.0), (0.0, 0.0)
    profiler = cProfile.Profile(time.thread_time) if profile is not None else None

    def on_message(body: Any, message: Any) -> None:
        nonlocal done, first, last
        if done == 0:
            first = (time.perf_counter(), time.thread_time())
            if profiler is not None:
                profiler.enable()
        handle(body, message)
        done += 1
        if done == n:
            last = (time.perf_counter(), time.thread_time())
            if profiler is not None:
                profiler.disable()
                profiler.dump_stats(str(profile))

    with kombu.Connection(RABBITMQ_URL) as conn:
        source = kombu.Queue(queue or bench.queue, no_declare=True)
        with conn.Consumer([source], callbacks=[on_message], prefetch_count=PREFETCH, accept=["json"]):
            while done < n:
                try:
                    conn.drain_events(timeout=30)
                except TimeoutError:
                    raise BenchError(f"kombu consumer idle for 30s after {done}/{n} messages") from None
    return last[0] - first[0], last[1] - first[1]


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


def wire_consumer(bench: Bench) -> Path | None:
    """benchmarks/c_consumer.c built with the system compiler into the run's folder (once), or
    None when the compiler or rabbitmq-c's headers (Debian's ``librabbitmq-dev``) are missing."""
    binary = bench.tmp / "c_consumer"
    if binary.exists():
        return binary
    cc = shutil.which("cc")
    if cc is None or not Path("/usr/include/amqp.h").exists():
        return None
    built = subprocess.run([cc, "-O2", "-o", str(binary), str(HERE / "c_consumer.c"), "-lrabbitmq"],
                           capture_output=True, text=True)
    if built.returncode:
        raise BenchError(f"cc benchmarks/c_consumer.c failed: {built.stderr.strip()}")
    return binary


def wire_drain(bench: Bench, kind: str, n: int) -> Timing:
    """The C consumer: prefetch 100, acking each message (``c-each``) or every 50th with
    ``multiple`` (``c-multi``); it times itself from its first message to its n-th."""
    binary = wire_consumer(bench)
    if binary is None:
        raise BenchError("no C consumer (install librabbitmq-dev)")
    done = subprocess.run([str(binary), "127.0.0.1", "5672", bench.queue, str(n), str(PREFETCH),
                           str(WIRE_CONSUMERS[kind])], capture_output=True, text=True, timeout=120 + n / 100)
    if done.returncode:
        raise BenchError(done.stderr.strip() or f"c_consumer exited with {done.returncode}")
    wall, cpu = map(float, done.stdout.split())
    return wall, cpu


def hand_written(bench: Bench, kind: str, n: int, trace: Path | None = None,
                 profile: Path | None = None) -> Timing:
    """A hand-written consumer: ``plain`` (kombu, ack each, no database), ``naive``, or the
    C consumer (``c-each``, ``c-multi``: neither traced nor profiled, it is not Python)."""
    bench.fresh_schema()
    if kind in WIRE_CONSUMERS:
        bench.load(n)
        return wire_drain(bench, kind, n)
    if kind == "naive":
        bench.prefill("bench_dedup")
    bench.load(n)
    if kind == "plain":
        return kombu_drain(bench, n, plain, profile)
    engine = create_engine(POSTGRES_URL)
    if trace is not None:
        event.listen(engine, "connect", lambda dbapi, _r: lb.trace_connection(dbapi, str(trace)))
    handle, db = exactly_once(engine, bench.schema)
    try:
        return kombu_drain(bench, n, handle, profile)
    finally:
        db.close()
        engine.dispose()


# -- the container ------------------------------------------------------------------------

def mdb(*args: str, env: dict[str, str]) -> None:
    cmd = [sys.executable, "-m", "mdbcontainer", *args]
    done = subprocess.run(cmd, env=env, cwd=HERE, capture_output=True, text=True, timeout=60)
    if done.returncode:
        raise BenchError(f"mdb {' '.join(args)} failed: {(done.stderr or done.stdout).strip()}")


def container(bench: Bench, port: str, n: int, *, trace: Path | None = None,
              profile: Path | None = None, latency: Path | None = None,
              load: Callable[[], None] | None = None,
              after: Callable[[ContainerProcess], None] | None = None,
              beside: Callable[[], None] | None = None) -> Timing:
    """``mdb run`` with its port stopped; load n messages, start the port, wait for the stamp.

    ``load`` replaces loading before the start (the latency run publishes at a steady
    rate after it); ``beside`` is called as the port starts (--paired starts the
    hand-written consumer then)."""
    bench.fresh_schema()
    stamp = bench.tmp / f"{port}-{uuid.uuid4().hex[:6]}.stamp"
    settings = write_settings(bench.tmp / "settings.toml", {
        "container": {"broker_url": RABBITMQ_URL, "database_url": POSTGRES_URL,
                      "listeners": ["listeners_bench"], "db_schema": bench.schema,
                      "dead_letter_queue": f"{bench.queue}.DLQ"},
        "ports": {name: {"destination": bench.queue, "concurrency": 1,
                         "once_only": options["transaction"] != "none", **options}
                  for name, options in PORTS.items()},
    })
    cli_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parent)]),
               "BENCH_SCHEMA": bench.schema}
    env = {**cli_env, "BENCH_N": str(n), "BENCH_STAMP": str(stamp),
           "BENCH_TRACE": str(trace or ""), "BENCH_PROFILE": str(profile or ""),
           "BENCH_LATENCY": str(latency or ""), **bench.container_env}
    config = ["-c", str(settings)]
    mdb("port", "stop", port, *config, env=cli_env)
    proc = ContainerProcess(settings, ports=[port], env=env, cwd=HERE,
                            log_path=bench.tmp / f"{port}.log")
    proc.start(wait=False)
    try:
        wait_for(lambda: _alive(proc) and proc.port_state(port), 60, 0.2, f"mdb run ({port}) to register")
        if PORTS[port]["transaction"] != "none":
            bench.prefill("mdb_dedup")
        if load is None:
            bench.load(n)
        marks = lb.trace_sizes(trace)
        mdb("port", "start", port, *config, env=cli_env)
        if beside is not None:  # after the command's own process has exited
            beside()
        if load is not None:
            wait_for(lambda: (proc.port_state(port) or {}).get("state") == "started", 30, 0.1, "the port")
            load()
        wait_for(lambda: _alive(proc) and stamp.exists(), 120 + n / 20, 0.1,
                 f"the container to handle {n} messages")
        elapsed, cpu = map(float, stamp.read_text().split())
        if trace is not None:
            lb.trace_sizes(trace, marks)
        if after is not None:
            after(proc)
        return elapsed, cpu
    finally:
        if proc.alive():
            try:
                proc.terminate(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def _alive(proc: ContainerProcess) -> bool:
    if not proc.alive():
        last = (proc.output().strip().splitlines() or ["(no output)"])[-1]
        raise BenchError(f"mdb run exited with {proc.proc and proc.proc.returncode}: {last}")
    return True


def steady_latency(bench: Bench, args: argparse.Namespace, rate: float = 500.0,
                   seconds: float = 20.0) -> None:
    """p50/p99 delivery latency of the batch port at a steady ``rate`` (batch_linger 20ms)."""
    n = int(rate * seconds)
    samples = bench.tmp / "latency.txt"

    def publish_steadily() -> None:
        with kombu.Connection(RABBITMQ_URL, connect_timeout=5) as conn:
            producer = kombu.Producer(conn.channel())
            start = time.perf_counter()
            for i in range(n):
                pause = start + i / rate - time.perf_counter()
                if pause > 0:
                    time.sleep(pause)
                producer.publish({"n": i, "sent": time.time()}, exchange="", routing_key=bench.queue,
                                 serializer="json", delivery_mode=2, message_id=f"{bench.tag}-lat-{i}")

    container(bench, "BenchBatch", n, latency=samples, load=publish_steadily)
    values = sorted(float(x) for x in samples.read_text().split())
    p50, p99 = values[len(values) // 2], values[int(len(values) * 0.99)]
    print(f"\nlatency at a steady {rate:.0f} msg/s for {seconds:.0f}s, BenchBatch (batch_size {BATCH}, "
          f"batch_linger 20ms): p50 {p50 * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms, max "
          f"{values[-1] * 1000:.1f} ms ({len(values)} messages; publish to batch handler call)")


def rss_growth(bench: Bench, args: argparse.Namespace, total: int = 200_000) -> None:
    """RSS of ``mdb run`` (BenchBatch) after its first ``--n`` messages and after ``total``."""
    port, chunk = "BenchBatch", bench.n
    seen: dict[str, int] = {}

    def rss_kb(proc: ContainerProcess) -> int:
        status = Path(f"/proc/{proc.pid}/status").read_text()
        return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS")))

    def keep_going(proc: ContainerProcess) -> None:
        seen[f"{chunk}"] = rss_kb(proc)
        handled = chunk
        while handled < total:
            bench.load(chunk, wait=False)
            handled += chunk
            wait_for(lambda target=handled: (proc.port_state(port) or {}).get("handled", 0) >= target,
                     600, 0.5, f"{handled} handled")
        seen[f"{total}"] = rss_kb(proc)

    container(bench, port, chunk, after=keep_going)
    first, last = seen[f"{chunk}"], seen[f"{total}"]
    print(f"\nRSS of mdb run ({port}): {first / 1024:.1f} MiB after {chunk:,} messages, "
          f"{last / 1024:.1f} MiB after {total:,} ({(last / first - 1) * 100:+.1f}%; target within 10%)")


# -- main ---------------------------------------------------------------------------------

def contestant(name: str) -> Callable[..., Timing]:
    """Run one contestant: a hand-written consumer or a port of ``mdb run``."""
    def run(bench: Bench, n: int, **options: Any) -> Timing:
        if name in PORTS:
            return container(bench, name, n, **options)
        return hand_written(bench, name, n, **options)
    return run


def label(name: str) -> str:
    return {"plain": "kombu plain", "naive": "kombu+SQL", "c-each": "C ack each",
            "c-multi": f"C ack/{WIRE_ACK_EVERY}"}.get(name, name)


def paired(bench: Bench, port: str, n: int, hand: Result, box: Result) -> None:
    """The plain kombu consumer on a queue of its own, in a thread of this process, started
    with the port: both drain at the same time, so both see the same load (their CPU per
    message is then comparable on a busy machine; each slows the other a little)."""
    bench.load(n, queue=bench.side)
    done: list[Timing] = []
    errors: list[BaseException] = []

    def drain() -> None:
        try:
            done.append(kombu_drain(bench, n, plain, queue=bench.side))
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    thread = threading.Thread(target=drain, name="bench-plain", daemon=True)
    box.run(lambda: contestant(port)(bench, n, beside=thread.start))
    thread.join(60)
    if errors or not done:
        raise BenchError(f"the paired kombu consumer failed: {errors[0] if errors else 'timed out'}")
    hand.timings.append(done[0])
    hand.loads.append(box.loads[-1])


def run_scenario(bench: Bench, scenario: str, args: argparse.Namespace) -> list[Result]:
    """Alternate the contestants ``--repeat`` times (or run them side by side with
    ``--paired``), then the traced pass and the profile."""
    n = bench.n
    base, port = SCENARIOS[scenario]
    if base in WIRE_CONSUMERS and wire_consumer(bench) is None:
        print(f"scenario {scenario} skipped: the C consumer needs cc and librabbitmq-dev "
              "(apt-get install librabbitmq-dev)", flush=True)
        return []
    hand, box = Result(scenario, label(base), n), Result(scenario, port, n)
    prof = args.profile / f"{scenario}.prof" if args.profile else None
    base_prof = args.profile / f"{scenario}-{base}.prof" if args.profile else None
    for i in range(args.repeat):
        if args.paired:
            if base != "plain":
                raise BenchError(f"--paired needs a scenario with the plain consumer: {scenario} has {base}")
            paired(bench, port, n, hand, box)
            continue
        hand.run(lambda i=i: contestant(base)(bench, n, profile=base_prof if i == 0 else None))
        box.run(lambda i=i: contestant(port)(bench, n, profile=prof if i == 0 else None))
    traced = [(r, name) for r, name in ((hand, base), (box, port)) if name not in WIRE_CONSUMERS]
    for result, name in traced if args.trace_n else ():
        folder = bench.tmp / f"trace-{scenario}-{name}"
        folder.mkdir()
        run = contestant(name)
        run(bench, args.trace_n, trace=folder)
        suffix = ".window" if name in PORTS else ".trace"
        result.round_trips = lb.count_trace(folder, suffix, args.trace_n)
    profiled = [(p, who) for p, who in ((base_prof, label(base)), (prof, port))
                if p is not None and p.exists()]
    for path, who in profiled:
        print(f"\n--- cProfile of the {scenario} {who} consumer thread, CPU clock ({path}; "
              "top 25 by own time) ---")
        pstats.Stats(str(path)).sort_stats("tottime").print_stats(25)
    return [hand, box]


def report(results: list[Result]) -> None:
    """The table. A ratio from a run that started at a load average of MAX_LOAD or more is no
    figure: it is shown in brackets, with no verdict; the CPU columns (the consumer thread's CPU time per message,
    and the baseline's over the container's) are the figures that hold under load."""
    print(f"\n{'scenario':<19}{'contestant':<18}{'msgs/s':>8}{'ratio':>8}  {'target':<12}"
          f"{'runs (msgs/s)':<24}{'CPU us/msg':>11}{'CPU x':>7}{'load':>6}  DB round trips/msg")
    base: dict[str, Result] = {}
    loaded = False
    for r in results:
        ratio = target = cpu_ratio = ""
        if r.scenario not in base:
            base[r.scenario] = r
        else:
            first = base[r.scenario]
            value = r.rate / first.rate
            cpu_ratio = f"{first.cpu_us / r.cpu_us:.2f}"
            if max(first.loads + r.loads) >= MAX_LOAD:
                loaded = True
                ratio, target = f"({value:.2f})", f">={TARGETS[r.scenario]:.2f} -"
            else:
                ratio = f"{value:.2f}"
                target = f">={TARGETS[r.scenario]:.2f} " + ("ok" if value >= TARGETS[r.scenario] else "MISS")
        runs = " ".join(f"{rate:,.0f}" for rate in r.rates)
        print(f"{r.scenario:<19}{r.contestant:<18}{r.rate:>8,.0f}{ratio:>8}  {target:<12}{runs:<24}"
              f"{r.cpu_us:>11,.0f}{cpu_ratio:>7}{max(r.loads):>6.1f}  {r.round_trips}")
    if loaded:
        print(f"\n(ratio): a run started at a load average of {MAX_LOAD:g} or more (column load: the "
              "1-minute load average before the contestant's runs, the highest if several), so not "
              "a figure and not checked against its target. CPU x "
              "is the baseline's CPU per message over the container's: where the consumer thread "
              "is CPU-bound, the ratio an idle machine would show.")


def main() -> int:
    global IDLE_WAIT
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=20000, help="messages per contestant and run")
    parser.add_argument("--scenario", choices=[*SCENARIOS, "latency", "rss", "all"], default="all",
                        help="all: every throughput scenario (latency and rss run only when named)")
    parser.add_argument("--repeat", type=int, default=1, help="runs per contestant (the median counts)")
    parser.add_argument("--trace-n", type=int, default=500, help="messages of the traced pass (0: skip)")
    parser.add_argument("--profile", type=Path, metavar="DIR",
                        help="cProfile the container's first run into DIR (slows it down)")
    parser.add_argument("--paired", action="store_true",
                        help="run the plain kombu consumer beside the container, at the same time "
                             "(none, batch, batch-per-message): CPU per message under the same load")
    parser.add_argument("--tracing", action="store_true",
                        help="run mdb run with tracing on, exporting OTLP/HTTP to a sink (the otel extra)")
    parser.add_argument("--idle-wait", type=float, default=IDLE_WAIT, metavar="SECONDS",
                        help="before each contestant's run, wait up to this long for the 1-minute "
                             "load average to fall below 1 (0: do not wait)")
    parser.add_argument("--dedup-rows", type=int, default=0,
                        help="fill both dedup tables with this many old rows first (e.g. 2000000)")
    args = parser.parse_args()
    IDLE_WAIT = args.idle_wait
    if args.profile:
        args.profile = args.profile.resolve()
        args.profile.mkdir(parents=True, exist_ok=True)
    scenarios = list(SCENARIOS) if args.scenario == "all" else [args.scenario]
    print(f"N={args.n}, prefetch {PREFETCH}, one consumer, tracing {'on' if args.tracing else 'off'}; "
          "load averages before: "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    with services_kept_up(), otlp_sink() as sink:
        bench = Bench(args.n)
        bench.dedup_rows = args.dedup_rows
        if args.tracing:
            bench.container_env = {"MDB_CONTAINER__TRACING": "true", "OTEL_SERVICE_NAME": "bench",
                                   "OTEL_EXPORTER_OTLP_ENDPOINT": sink}
        try:
            if scenarios == ["latency"]:
                steady_latency(bench, args)
                return 0
            if scenarios == ["rss"]:
                rss_growth(bench, args)
                return 0
            results = [r for s in scenarios for r in run_scenario(bench, s, args)]
        except Exception as exc:  # one line; the queue and schema are removed all the same
            print(f"benchmark failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
        finally:
            bench.close()
    report(results)
    print(f"\nload averages after: {' '.join(f'{x:.2f}' for x in os.getloadavg())} "
          f"({os.cpu_count()} cores, shared with whatever else runs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
