"""Redelivery delays that do not hold the line: the good messages' rate with 1% failing.

Two runs of one ``mdb run`` port (``BenchDelayed``: container-managed, once-only,
prefetch 100, one consumer) on RabbitMQ and PostgreSQL, each draining N
persistent messages from a fresh durable queue:

- ``clean``: no message fails;
- ``failing``: 1% of them (every 100th) fail twice, with ``redelivery_delay =
  "1s"``, and succeed on their third delivery.

Each run is timed from the first good message handled to the last (the
failing ones are not in the rate). The target: the ``failing`` rate at least
0.9 x the ``clean`` rate. With the delay slept in the consumer (before this
change) every failure stalled the port for its second: 2 x N/100 seconds.
See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import kombu
from sqlalchemy import create_engine, func, select, text

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the repository, for a checkout without an editable install
import listeners_bench as lb  # noqa: E402  (the script's own folder is on sys.path)

from mdbcontainer.broker import Broker  # noqa: E402
from mdbcontainer.delays import wait_queues  # noqa: E402
from mdbcontainer.settings import QueueSettings, load_settings  # noqa: E402
from mdbcontainer.testing import ContainerProcess, wait_for, write_settings  # noqa: E402

RABBITMQ_URL = "amqp://guest:guest@127.0.0.1:5672//"
POSTGRES_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
PREFETCH = 100
TARGET = 0.90
QUEUE_KEYS = {"redelivery_delay": "1s", "backout_threshold": 5}


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


class Run:
    """One run's queue (and its wait queues), PostgreSQL schema and scratch folder."""

    def __init__(self, n: int, failing: bool) -> None:
        self.n = n
        self.failing = failing
        self.tag = uuid.uuid4().hex[:8]
        self.queue = f"bench-delays-{self.tag}"
        self.schema = f"bench_{self.tag}"
        self.tmp = Path(tempfile.mkdtemp(prefix="mdb-bench-delays-"))
        self.engine = create_engine(POSTGRES_URL)
        self.queues = [self.queue, f"{self.queue}.DLQ",
                       *wait_queues(self.queue, QueueSettings(**QUEUE_KEYS))]

    def fails(self, i: int) -> int:
        """Deliveries message ``i`` fails: 2 for every 100th in the failing run."""
        return 2 if self.failing and i % 100 == 50 else 0

    @property
    def good(self) -> int:
        return sum(1 for i in range(self.n) if not self.fails(i))

    def settings(self) -> Path:
        with self.engine.begin() as conn:
            conn.execute(text(f'CREATE SCHEMA "{self.schema}"'))
        lb.effects_table(self.schema).create(self.engine)
        return write_settings(self.tmp / "settings.toml", {
            "container": {"broker_url": RABBITMQ_URL, "database_url": POSTGRES_URL,
                          "db_schema": self.schema, "listeners": ["listeners_delays"],
                          "dead_letter_queue": f"{self.queue}.DLQ", "control_interval": "500ms"},
            "ports": {"BenchDelayed": {"destination": self.queue, "prefetch": PREFETCH,
                                       "max_retries": 1000}},
            "queues": {self.queue: QUEUE_KEYS},
        })

    def load(self, settings: Path) -> None:
        """Declare the queue and its waits as the container does, and publish the N messages."""
        broker = Broker(load_settings(settings, environ={}))
        with broker.connect() as conn:
            channel = conn.channel()
            broker.declare_queue(channel, self.queue)
            producer = kombu.Producer(channel)
            for i in range(self.n):
                producer.publish({"n": i, "fail": self.fails(i)}, exchange="", routing_key=self.queue,
                                 serializer="json", delivery_mode=2, message_id=f"{self.tag}-{i}")

    def measure(self) -> tuple[float, float]:
        """The good messages' rate, and the seconds from the container's start to every message handled."""
        settings = self.settings()
        stamp = self.tmp / "stamp"
        env = {"BENCH_N": str(self.good), "BENCH_STAMP": str(stamp), "BENCH_SCHEMA": self.schema,
               "PYTHONPATH": f"{HERE}{os.pathsep}{HERE.parent}"}
        self.load(settings)  # before the container starts: neither loading nor start-up is timed
        with ContainerProcess(settings, env=env, cwd=HERE) as container:
            began = time.monotonic()
            wait_for(stamp.exists, 600, 0.05, f"{self.good} good messages")
            elapsed = float(stamp.read_text())
            table = lb.effects_table(self.schema)
            with self.engine.connect() as conn:
                def rows() -> int:
                    return int(conn.execute(select(func.count()).select_from(table)).scalar_one())
                wait_for(lambda: rows() == self.n, 120, 0.2, f"all {self.n} messages handled")
                distinct = conn.execute(select(func.count(table.c.message_id.distinct()))).scalar_one()
            total = time.monotonic() - began
            if distinct != self.n:
                raise RuntimeError(f"{distinct} distinct messages applied of {self.n}")
            container.terminate()
        return self.good / elapsed, total

    def close(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)
        try:
            with kombu.Connection(RABBITMQ_URL, connect_timeout=5) as broker:
                channel = broker.channel()
                for name in self.queues:
                    channel.queue_delete(queue=name)
        except Exception as exc:
            print(f"warning: queues of {self.queue} left on RabbitMQ: {exc}", file=sys.stderr)
        with self.engine.begin() as conn:
            conn.execute(text(f'DROP SCHEMA IF EXISTS "{self.schema}" CASCADE'))
        self.engine.dispose()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=5000, help="messages per run")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each kind, alternated (median)")
    args = parser.parse_args()
    print(f"N={args.n}, prefetch {PREFETCH}, one consumer, container-managed once-only; failing run: "
          f"1% fail twice, redelivery_delay 1s; load averages before: "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    rates: dict[bool, list[float]] = {False: [], True: []}
    totals: dict[bool, list[float]] = {False: [], True: []}
    with services_kept_up():
        for _ in range(args.repeat):
            for failing in (False, True):
                run = Run(args.n, failing)
                try:
                    rate, total = run.measure()
                except Exception as exc:
                    print(f"benchmark failed: {type(exc).__name__}: {exc}", file=sys.stderr)
                    return 1
                finally:
                    run.close()
                rates[failing].append(rate)
                totals[failing].append(total)
    clean, failing = statistics.median(rates[False]), statistics.median(rates[True])
    ratio = failing / clean
    print(f"{'run':<10} {'good msg/s':>11}  {'runs':<28} {'all handled after':>18}")
    for kind, label in ((False, "clean"), (True, "failing")):
        runs = ", ".join(f"{r:.0f}" for r in rates[kind])
        print(f"{label:<10} {statistics.median(rates[kind]):>11.0f}  {runs:<28} "
              f"{statistics.median(totals[kind]):>17.1f}s")
    print(f"ratio failing / clean: {ratio:.2f} (target >= {TARGET}) "
          f"{'ok' if ratio >= TARGET else 'BELOW TARGET'}")
    stalled = 2 * (args.n // 100)
    print(f"(a delay slept in the consumer would have stalled the port {stalled} s in the failing run)")
    print(f"load averages after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0 if ratio >= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
