"""The outbox of code outside handlers (CONTRACT section 15): latency and throughput.

    .venv/bin/python benchmarks/outbox.py [--rate 500] [--seconds 10] [--n 2000]

RabbitMQ 127.0.0.1:5672 (guest) and PostgreSQL 127.0.0.1:5432/test (user
postgres), a schema and a queue of its own, dropped at the end.

1. Throughput: ``--n`` sends with ``Producer.send`` (each a confirmed publish),
   then ``--n`` with ``Outbox.send``, each in a transaction of its own (a row
   and a commit; no relay runs meanwhile), and the ratio outbox / direct
   (goal >= 0.8). Then the case the outbox is for: ``--n`` transactions that
   each store an order row, committed and then sent with ``Producer.send``,
   beside the same with ``Outbox.send`` inside the transaction.
2. Latency: ``mdb relay`` runs as a process of its own; sends are committed at
   ``--rate`` per second for ``--seconds``, one per transaction; a consumer on
   the queue notes when each arrives. Commit-to-delivery p50/p99/max (the
   publish, its confirm and the broker's delivery to a consumer included;
   goal p99 < 50 ms at 500 sends/s).

The load average (``os.getloadavg``) is printed beside the figures: on a busy
machine they are not an idle machine's.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import kombu
from sqlalchemy import create_engine, text
from sqlalchemy.orm import Session

from mdbcontainer import Outbox, Producer, load_settings
from mdbcontainer.state.outbox import RELAY_LOCK_CLASS
from mdbcontainer.testing import write_settings

ROOT = Path(__file__).resolve().parent.parent
RABBITMQ = "amqp://guest:guest@127.0.0.1:5672//"
POSTGRES = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def throughput(settings: Any, queue: str, n: int) -> tuple[float, float]:
    """Sends per second: Producer.send, then Outbox.send (one transaction each)."""
    with Producer.from_settings(settings) as producer:
        producer.send(queue, {"warm": True})
        began = time.perf_counter()
        for i in range(n):
            producer.send(queue, {"n": i})
        direct = n / (time.perf_counter() - began)
    outbox = Outbox.from_settings(settings)
    engine = create_engine(settings.container.database_url)
    with Session(engine) as session, session.begin():
        outbox.send(session, queue, {"warm": True})
    began = time.perf_counter()
    for i in range(n):
        with Session(engine) as session, session.begin():
            outbox.send(session, queue, {"n": i})
    rate = n / (time.perf_counter() - began)
    engine.dispose()
    outbox.store.dispose()
    return direct, rate


def orders(settings: Any, queue: str, schema: str, n: int) -> tuple[float, float]:
    """Orders per second, each a transaction storing an order row that must be announced:
    committed then sent with Producer.send (what the outbox replaces), or sent through the outbox."""
    insert = text(f'INSERT INTO "{schema}".orders (amount) VALUES (:amount)')
    engine = create_engine(settings.container.database_url)
    with Producer.from_settings(settings) as producer:
        began = time.perf_counter()
        for i in range(n):
            with Session(engine) as session, session.begin():
                session.execute(insert, {"amount": i})
            producer.send(queue, {"order": i})
        direct = n / (time.perf_counter() - began)
    outbox = Outbox.from_settings(settings)
    began = time.perf_counter()
    for i in range(n):
        with Session(engine) as session, session.begin():
            session.execute(insert, {"amount": i})
            outbox.send(session, queue, {"order": i})
    rate = n / (time.perf_counter() - began)
    engine.dispose()
    outbox.store.dispose()
    return direct, rate


class Arrivals:
    """A consumer of ``queue`` in a thread: when each message id arrived (monotonic seconds)."""

    def __init__(self, queue: str) -> None:
        self.queue = queue
        self.at: dict[str, float] = {}
        self.stop = threading.Event()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        self.ready.wait(30)

    def _run(self) -> None:
        with kombu.Connection(RABBITMQ) as conn:
            q = kombu.Queue(self.queue, durable=True)

            def got(_body: Any, message: Any) -> None:
                self.at[message.properties.get("message_id")] = time.monotonic()
                message.ack()

            with conn.Consumer([q], callbacks=[got], prefetch_count=500, accept=["json"]):
                self.ready.set()
                while not self.stop.is_set():
                    try:
                        conn.drain_events(timeout=0.2)
                    except TimeoutError:
                        pass


def latency(settings_path: Path, settings: Any, queue: str, rate: int, seconds: float) -> list[float]:
    relay = subprocess.Popen([sys.executable, "-m", "mdbcontainer", "relay", "-c", str(settings_path)],
                             cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    arrivals = Arrivals(queue)
    outbox = Outbox.from_settings(settings)
    engine = create_engine(settings.container.database_url)
    committed: dict[str, float] = {}
    try:
        wait_for_relay(engine, relay)
        interval = 1.0 / rate
        began = time.monotonic()
        for i in range(int(rate * seconds)):
            due = began + i * interval
            pause = due - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            with Session(engine) as session, session.begin():
                message_id = outbox.send(session, queue, {"n": i})
            committed[message_id] = time.monotonic()
        achieved = len(committed) / (time.monotonic() - began)
        print(f"  sent {len(committed)} at {achieved:.0f}/s (asked {rate}/s)", flush=True)
        deadline = time.monotonic() + 30
        while len([m for m in committed if m in arrivals.at]) < len(committed) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        relay.send_signal(signal.SIGTERM)
        relay.wait(30)
        arrivals.stop.set()
        arrivals.thread.join(5)
        engine.dispose()
        outbox.store.dispose()
    missing = [m for m in committed if m not in arrivals.at]
    if missing:
        print(f"  {len(missing)} send(s) did not arrive within 30 s", flush=True)
    return [arrivals.at[m] - committed[m] for m in committed if m in arrivals.at]


def wait_for_relay(engine: Any, relay: subprocess.Popen[bytes]) -> None:
    """Until ``mdb relay`` holds the fleet's relay lock (and listens): its start is not timed."""
    deadline = time.monotonic() + 120
    query = text(f"SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND classid = "
                 f"{RELAY_LOCK_CLASS} AND granted")
    while time.monotonic() < deadline and relay.poll() is None:
        with engine.connect() as conn:
            if conn.execute(query).scalar():
                time.sleep(0.2)  # its LISTEN follows the lock at once
                return
        time.sleep(0.1)
    raise SystemExit("mdb relay did not take the relay lock within 120 s")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rate", type=int, default=500, help="sends per second for the latency run")
    parser.add_argument("--seconds", type=float, default=10.0, help="length of the latency run")
    parser.add_argument("--n", type=int, default=2000, help="sends of each kind for the throughput")
    args = parser.parse_args()

    tag = uuid.uuid4().hex[:8]
    schema, queue = f"bench_outbox_{tag}", f"BENCH-OUTBOX-{tag}"
    admin = create_engine(POSTGRES)
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
        conn.execute(text(f'CREATE TABLE "{schema}".orders (id serial PRIMARY KEY, amount integer)'))
    folder = Path(tempfile.mkdtemp(prefix="mdb-bench-outbox-"))
    path = write_settings(folder / "settings.toml", {
        "container": {"broker_url": RABBITMQ, "database_url": POSTGRES, "db_schema": schema,
                      "listeners": [], "log_level": "WARNING"},
        "ports": {}, "queues": {queue: {}},
    })
    settings = load_settings(path, environ={})
    Outbox.from_settings(settings).create_tables()
    try:
        print(f"load before: {load()}  (1, 5, 15 min; 2 cores: figures above ~1 are not idle)")
        direct, rate = throughput(settings, queue, args.n)
        print(f"throughput ({args.n} each): Producer.send {direct:.0f}/s, Outbox.send + commit "
              f"{rate:.0f}/s, ratio {rate / direct:.2f} (goal >= 0.80)   load {load()}", flush=True)
        direct, rate = orders(settings, queue, schema, args.n)
        print(f"orders ({args.n} each, an order row per transaction): commit then Producer.send "
              f"{direct:.0f}/s, Outbox.send in the transaction {rate:.0f}/s, ratio {rate / direct:.2f}"
              f"   load {load()}", flush=True)
        with kombu.Connection(RABBITMQ) as conn:
            conn.default_channel.queue_purge(queue)
        with admin.begin() as conn:
            conn.execute(text(f'DELETE FROM "{schema}".mdb_outbox'))
        lat = latency(path, settings, queue, args.rate, args.seconds)
        if lat:
            print(f"commit-to-delivery at {args.rate}/s for {args.seconds:.0f}s, {len(lat)} sends: "
                  f"p50 {percentile(lat, 0.5) * 1000:.1f} ms, p99 {percentile(lat, 0.99) * 1000:.1f} ms, "
                  f"max {max(lat) * 1000:.1f} ms, mean {statistics.mean(lat) * 1000:.1f} ms "
                  f"(goal p99 < 50 ms)   load {load()}", flush=True)
    finally:
        with kombu.Connection(RABBITMQ) as conn:
            conn.default_channel.queue_delete(queue)
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        admin.dispose()


if __name__ == "__main__":
    main()
